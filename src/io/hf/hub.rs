//! `hf:ORG/NAME[@REVISION]` locations: the hub snapshot holding a model's config, weights (single
//! or sharded) and tokenizer files, fetched into the cache unless offline.
//!
//! Offline use: with `HF_HUB_OFFLINE=1` (or no network) an `hf:` id resolves from the cache under
//! `HF_HOME` (default `~/.cache/huggingface`) and a missing file is an error naming it and where
//! it was looked for.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

pub(super) const WEIGHTS: &str = "model.safetensors";
pub(super) const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

/// `hf:ORG/NAME` or `hf:ORG/NAME@REVISION`.
pub fn parse_hub_id(loc: &str) -> Option<(String, Option<String>)> {
    let id = loc.strip_prefix("hf:")?;
    Some(match id.split_once('@') {
        Some((i, r)) => (i.to_string(), Some(r.to_string())),
        None => (id.to_string(), None),
    })
}

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !v.is_empty() && v != "0" && v.to_lowercase() != "false")
}

/// A local directory for `loc`: the path itself, or the hub snapshot holding an `hf:` id's
/// config, weights (single or sharded) and tokenizer files, fetched into the cache unless offline.
pub fn resolve_location(loc: &str) -> Result<PathBuf> {
    let Some((id, revision)) = parse_hub_id(loc) else { return Ok(PathBuf::from(loc)) };
    let repo = match &revision {
        Some(r) => hf_hub::Repo::with_revision(id.clone(), hf_hub::RepoType::Model, r.clone()),
        None => hf_hub::Repo::model(id.clone()),
    };
    let cache = hf_hub::Cache::from_env();
    let cached = cache.repo(repo.clone());
    let fetch = |file: &str, required: bool| -> Result<Option<PathBuf>> {
        if let Some(p) = cached.get(file) {
            return Ok(Some(p));
        }
        if offline() {
            if required {
                bail!("{loc}: {file} is not in the Hugging Face cache ({}) and HF_HUB_OFFLINE is set; download it where there is network (e.g. `huggingface-cli download {id}`) and copy the cache", cache.path().display());
            }
            return Ok(None);
        }
        let api = hf_hub::api::sync::ApiBuilder::from_env().with_progress(false).build().context("starting the Hugging Face hub client")?;
        match api.repo(repo.clone()).get(file) {
            Ok(p) => Ok(Some(p)),
            Err(e) if required => Err(anyhow!("{loc}: cannot fetch {file}: {e} (no network? set HF_HUB_OFFLINE=1 to use the cache only)")),
            Err(_) => Ok(None),
        }
    };
    let config = fetch("config.json", true)?.expect("required");
    match fetch(WEIGHTS, false)? {
        Some(_) => {}
        None => {
            let index =
                fetch(WEIGHTS_INDEX, true).with_context(|| format!("{loc}: neither {WEIGHTS} nor {WEIGHTS_INDEX}"))?.expect("required");
            for shard in shard_files(&index)? {
                fetch(&shard, true)?;
            }
        }
    }
    for optional in ["tokenizer.json", "vocab.txt", "tokenizer_config.json", "preprocessor_config.json"] {
        fetch(optional, false)?;
    }
    Ok(config.parent().expect("a file in a snapshot").to_path_buf())
}

pub(super) fn shard_files(index: &Path) -> Result<Vec<String>> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(index).with_context(|| format!("reading {}", index.display()))?)?;
    let map = v.get("weight_map").and_then(Value::as_object).ok_or_else(|| anyhow!("{} has no weight_map", index.display()))?;
    let mut files: Vec<String> = map.values().filter_map(Value::as_str).map(String::from).collect();
    files.sort();
    files.dedup();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_with_and_without_revision() {
        assert_eq!(parse_hub_id("hf:kakaobrain/align-base"), Some(("kakaobrain/align-base".into(), None)));
        assert_eq!(parse_hub_id("hf:org/m@v1.0"), Some(("org/m".into(), Some("v1.0".into()))));
        assert_eq!(parse_hub_id("checkpoints/run"), None);
    }

    #[test]
    fn offline_misses_name_the_file_and_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY of env mutation in tests: these variables are read only by this resolution.
        std::env::set_var("HF_HOME", dir.path());
        std::env::set_var("HF_HUB_OFFLINE", "1");
        let err = resolve_location("hf:nobody/nothing").unwrap_err().to_string();
        assert!(err.contains("config.json") && err.contains("HF_HUB_OFFLINE") && err.contains(&dir.path().display().to_string()), "{err}");
    }
}
