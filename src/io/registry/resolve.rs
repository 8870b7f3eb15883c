//! A location resolved into a local directory and the format it holds.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use super::formats::{read_list, FORMATS};
use crate::io::format::align_run::AlignRun;
use crate::io::format::hf::hub::{parse_hub_id, HubRepo};
use crate::io::format::Format;

/// A checkpoint found: where its files are, and how to read them.
pub struct Located {
    pub dir: PathBuf,
    pub format: &'static dyn Format,
    /// The location as the user gave it, for messages and records.
    pub location: String,
}

impl std::fmt::Debug for Located {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({} format at {})", self.location, self.format.name(), self.dir.display())
    }
}

/// The files whose presence says which format a hub repository holds.
const CONFIG_FILES: [&str; 3] = ["config.json", "open_clip_config.json", crate::io::run_dir::SPEC_FILE];

/// Resolves `loc`: a checkpoint directory, a run directory (its latest checkpoint), or
/// `hf:ORG/NAME[@REVISION]` (fetched into the hub cache unless it is there or offline).
pub fn locate(loc: &str) -> Result<Located> {
    if let Some((id, revision)) = parse_hub_id(loc) {
        return locate_on_hub(loc, &id, revision.as_deref());
    }
    let path = Path::new(loc);
    if !path.exists() {
        bail!("{loc} does not exist (a checkpoint is a directory, a run directory, or hf:ORG/NAME)");
    }
    if !path.is_dir() {
        // A training checkpoint named as a file (open_clip's `epoch_N.pt` beside its
        // open_clip_config.json) is the one kind of file a format reads.
        if let Some(format) = FORMATS.iter().copied().find(|f| f.detect(path)) {
            return Ok(Located { dir: path.to_path_buf(), format, location: loc.to_string() });
        }
        bail!(
            "{loc} is a file; a checkpoint is a directory (formats read: {}), or open_clip's training checkpoint (epoch_N.pt) beside the model's open_clip_config.json",
            read_list()
        );
    }
    let dir = if path.join(crate::io::run_dir::LATEST).is_file() && !AlignRun.detect(path) {
        crate::io::run_dir::resolve(path)?
    } else {
        path.to_path_buf()
    };
    match FORMATS.iter().copied().find(|f| f.detect(&dir)) {
        Some(format) => Ok(Located { dir, format, location: loc.to_string() }),
        None => Err(unrecognised(loc, &dir)),
    }
}

/// The directory of a single tower's Hugging Face checkpoint (`model.init_text`,
/// `model.init_image`: a `BertModel`, a `ViTModel`), a folder or `hf:ORG/NAME[@REVISION]`.
pub fn locate_tower(loc: &str) -> Result<PathBuf> {
    if let Some((id, revision)) = parse_hub_id(loc) {
        let mut repo = HubRepo::new(&id, revision.as_deref());
        if repo.fetch("config.json")?.is_none() {
            return Err(repo.not_found(&["config.json"]));
        }
        crate::io::format::hf::files::fetch_hf_model(&mut |file: &str| repo.fetch(file))?;
        return Ok(repo.snapshot().expect("a fetched file has a snapshot"));
    }
    let path = PathBuf::from(loc);
    if !path.join("config.json").is_file() {
        bail!("{loc} is not a Hugging Face model directory (it has no config.json)");
    }
    Ok(path)
}

fn locate_on_hub(loc: &str, id: &str, revision: Option<&str>) -> Result<Located> {
    let mut repo = HubRepo::new(id, revision);
    let mut found = false;
    for file in CONFIG_FILES {
        found |= repo.fetch(file)?.is_some();
    }
    if !found {
        return Err(repo.not_found(&CONFIG_FILES));
    }
    let dir = repo.snapshot().expect("a fetched file has a snapshot");
    for format in FORMATS {
        if !format.claims(&dir) {
            continue;
        }
        format.fetch_from_hub(&mut |file: &str| repo.fetch(file))?;
        if format.detect(&dir) {
            return Ok(Located { dir, format, location: loc.to_string() });
        }
    }
    Err(unrecognised(loc, &dir))
}

/// What is wrong with a directory no format recognises, as precisely as its files allow.
fn unrecognised(loc: &str, dir: &Path) -> anyhow::Error {
    let formats = read_list();
    let config = dir.join("config.json");
    if config.is_file() {
        match crate::io::format::hf::files::read_json(&config) {
            Err(e) => return anyhow::anyhow!("{loc}: {e:#}"),
            Ok(c) => {
                if let Some(t) = c.get("model_type").and_then(serde_json::Value::as_str) {
                    if let Some(f) = FORMATS.iter().find(|f| f.claims(dir)) {
                        return anyhow::anyhow!("{loc} is a Hugging Face {} ({t:?}) but its weights are missing (model.safetensors, or model.safetensors.index.json and its shards)", f.name());
                    }
                    return anyhow::anyhow!("{loc} is a Hugging Face {t:?} model, which align does not read; it reads {formats}");
                }
            }
        }
    }
    if dir.join("open_clip_config.json").is_file() {
        return anyhow::anyhow!("{loc} has open_clip_config.json but neither open_clip_model.safetensors nor open_clip_pytorch_model.bin");
    }
    if dir.join(crate::io::run_dir::SPEC_FILE).is_file() {
        return anyhow::anyhow!("{loc} is an align checkpoint without its {}", crate::io::run_dir::MODEL_FILE);
    }
    anyhow::anyhow!("{loc} holds no checkpoint align reads; it reads {formats}")
}
