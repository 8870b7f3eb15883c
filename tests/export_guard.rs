//! `align export` never destroys what is in `--out`: a non-empty directory is refused unless
//! forced, a forced export replaces it whole (no stale file of the old model survives), nothing is
//! written inside an align run directory, a second export to the same place while one runs is
//! refused, and a failed export leaves the directory as it was, with no partial files beside it.

mod common;

use std::path::{Path, PathBuf};

use align::io::load::load_model;
use align::io::registry::{export::export, named};
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
    export(&siglip.files().unwrap(), named("SiglipModel").unwrap(), &out, true).unwrap();
    assert!(!out.join("vocab.json").exists() && !out.join("merges.txt").exists(), "a file of the replaced model survived");
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

/// `--force` replaces what an earlier export wrote and nothing else: a file someone else put
/// there, or a run at any depth, is refused by name and left as it was.
#[test]
fn forcing_replaces_only_an_earlier_exports_files() {
    let dir = tempfile::tempdir().unwrap();
    let clip = load_model(&fixtures().join("towers/clip-tiny"), &Device::Cpu).unwrap();
    let out = dir.path().join("model");
    export(&clip.files().unwrap(), named("CLIPModel").unwrap(), &out, false).unwrap();
    std::fs::create_dir(out.join("notes")).unwrap();
    std::fs::write(out.join("notes/results.csv"), "mine").unwrap();
    let before = listing(&out);
    let err = format!("{:#}", export(&clip.files().unwrap(), named("CLIPModel").unwrap(), &out, true).unwrap_err());
    assert!(err.contains("did not write") && err.contains("results.csv"), "{err}");
    assert_eq!(listing(&out), before);
    std::fs::remove_dir_all(out.join("notes")).unwrap();

    // A folder of the user's own, with no export in it.
    let theirs = dir.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::write(theirs.join("config.json"), "{}").unwrap();
    let err = format!("{:#}", export(&clip.files().unwrap(), named("CLIPModel").unwrap(), &theirs, true).unwrap_err());
    assert!(err.contains("did not write") && err.contains("config.json"), "{err}");
    assert_eq!(std::fs::read(theirs.join("config.json")).unwrap(), b"{}");

    // A training run below --out, as a user's experiment folder holds one.
    let (_, cfg, _) = common::tiny_run(&dir.path().join("exp"), &["train.steps=1", "train.checkpoint_every=1"]);
    align::train::trainer::train(&cfg, &common::cpu_options()).unwrap();
    let err = format!("{:#}", export(&clip.files().unwrap(), named("CLIPModel").unwrap(), &dir.path().join("exp"), true).unwrap_err());
    assert!(err.contains("holds the align run directory") && err.contains("tiny"), "{err}");
    assert!(cfg.run_dir().join("latest").exists(), "the run was touched");
    export(&clip.files().unwrap(), named("CLIPModel").unwrap(), &out, true).unwrap();
}

/// What a killed export leaves (its temporary directory, its lock file, the old export moved
/// aside) is cleaned by the next export to the same place, which says so.
#[test]
fn a_killed_exports_debris_is_cleaned_by_the_next_one() {
    let dir = tempfile::tempdir().unwrap();
    let clip = load_model(&fixtures().join("towers/clip-tiny"), &Device::Cpu).unwrap();
    let out = dir.path().join("model");
    std::fs::create_dir_all(dir.path().join(".model.partial-1234-5678/model")).unwrap();
    std::fs::write(dir.path().join(".model.partial-1234-5678/model/model.safetensors"), "half").unwrap();
    std::fs::write(dir.path().join(".model.export-lock"), "").unwrap();
    export(&clip.files().unwrap(), named("CLIPModel").unwrap(), &out, false).unwrap();
    let left: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(left, vec!["model".to_string()]);

    // Killed after moving the old export aside, before moving the new one in.
    let first = listing(&out);
    std::fs::rename(&out, dir.path().join(".model.old-99-1")).unwrap();
    std::fs::create_dir_all(dir.path().join(".model.partial-99-1/model")).unwrap();
    let err = format!("{:#}", export(&clip.files().unwrap(), named("CLIPModel").unwrap(), &out, false).unwrap_err());
    assert!(err.contains("not empty"), "the old export was not put back: {err}");
    assert_eq!(listing(&out), first);
    let left: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(left, vec!["model".to_string()], "a refused export left its lock or debris");
}

/// The same checkpoint exported twice gives the same bytes, in every format that writes it,
/// including open_clip's record of its tokenizer's folder.
#[test]
fn exports_of_one_checkpoint_are_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    let vtde = load_model(&fixtures().join("towers/vtde-tiny"), &Device::Cpu).unwrap();
    let clip = load_model(&fixtures().join("towers/clip-tiny"), &Device::Cpu).unwrap();
    let siglip = load_model(&fixtures().join("towers/siglip-tiny"), &Device::Cpu).unwrap();
    for (model, format) in [(&vtde, "VisionTextDualEncoderModel"), (&clip, "CLIPModel"), (&clip, "open_clip"), (&siglip, "SiglipModel")] {
        let a = dir.path().join("a").join(format);
        let b = dir.path().join("b").join(format);
        export(&model.files().unwrap(), named(format).unwrap(), &a, false).unwrap();
        export(&model.files().unwrap(), named(format).unwrap(), &b, false).unwrap();
        assert_eq!(listing(&a), listing(&b), "{format}");
        let text = listing(&a).iter().map(|(_, bytes)| String::from_utf8_lossy(bytes).into_owned()).collect::<String>();
        assert!(!text.contains("partial"), "{format}: the temporary directory's name was written");
    }
}
