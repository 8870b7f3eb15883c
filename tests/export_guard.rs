//! `align export` never destroys what is in `--out`: a non-empty directory is refused unless
//! forced, a forced export replaces it whole (no stale file of the old model survives), nothing is
//! written inside an align run directory, a second export to the same place while one runs is
//! refused, and a failed export leaves the directory as it was, with no partial files beside it.

mod common;

use std::path::{Path, PathBuf};

use align::io::format::{export::export, named};
use align::io::load::load_model;
use candle_core::Device;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn listing(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap_or_default())
        })
        .collect();
    v.sort();
    v
}

#[test]
fn a_non_empty_directory_is_refused_and_forcing_replaces_it_whole() {
    let dir = tempfile::tempdir().unwrap();
    let clip = load_model(&fixtures().join("towers/clip-tiny"), &Device::Cpu).unwrap();
    let siglip = load_model(&fixtures().join("towers/siglip-tiny"), &Device::Cpu).unwrap();
    let out = dir.path().join("model");
    export(&clip.files().unwrap(), named("CLIPModel").unwrap(), &out, false).unwrap();
    let before = listing(&out);
    let err = format!("{:#}", export(&siglip.files().unwrap(), named("SiglipModel").unwrap(), &out, false).unwrap_err());
    assert!(err.contains("not empty") && err.contains("--force"), "{err}");
    assert_eq!(listing(&out), before, "a refused export changed the directory");
    std::fs::write(out.join("vocab.txt"), "stale").unwrap();
    export(&siglip.files().unwrap(), named("SiglipModel").unwrap(), &out, true).unwrap();
    assert!(!out.join("vocab.txt").exists(), "a file of the replaced model survived");
    assert_eq!(load_model(&out, &Device::Cpu).unwrap().format.name(), "SiglipModel");
    let left: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(left, vec!["model".to_string()], "temporary directories or locks left beside it");
}

#[test]
fn a_run_directory_is_never_written_into() {
    let dir = tempfile::tempdir().unwrap();
    let (_, cfg, _) = common::tiny_run(dir.path(), &["train.steps=2", "train.checkpoint_every=2"]);
    let s = align::train::trainer::train(&cfg, &common::cpu_options()).unwrap();
    let m = load_model(&s.checkpoint, &Device::Cpu).unwrap();
    let before = listing(&s.checkpoint);
    for out in [s.checkpoint.clone(), s.checkpoint.join("export"), cfg.run_dir().join("export")] {
        let err = format!("{:#}", export(&m.files().unwrap(), named("VisionTextDualEncoderModel").unwrap(), &out, true).unwrap_err());
        assert!(err.contains("inside the align run directory"), "{}: {err}", out.display());
    }
    assert_eq!(listing(&s.checkpoint), before);
    assert!(load_model(&s.checkpoint, &Device::Cpu).is_ok());
}

#[test]
fn a_second_export_to_the_same_place_is_refused_while_one_runs() {
    let dir = tempfile::tempdir().unwrap();
    let m = load_model(&fixtures().join("towers/clip-tiny"), &Device::Cpu).unwrap();
    let out = dir.path().join("model");
    // The lock a running export holds.
    let lock = std::fs::File::create(dir.path().join(".model.export-lock")).unwrap();
    lock.try_lock().unwrap();
    let err = format!("{:#}", export(&m.files().unwrap(), named("CLIPModel").unwrap(), &out, false).unwrap_err());
    assert!(err.contains("another export"), "{err}");
    assert!(!out.exists());
    drop(lock);
    export(&m.files().unwrap(), named("CLIPModel").unwrap(), &out, false).unwrap();
}

#[test]
fn a_model_a_format_cannot_hold_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let m = load_model(&fixtures().join("towers/siglip-tiny"), &Device::Cpu).unwrap();
    let out = dir.path().join("model");
    let err = format!("{:#}", export(&m.files().unwrap(), named("open_clip").unwrap(), &out, false).unwrap_err());
    assert!(err.contains("cannot export as open_clip") && err.contains("timm"), "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
