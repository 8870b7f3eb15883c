//! `hf:ORG/NAME[@REVISION]` locations: files of a hub repository, taken from the local cache or
//! downloaded into it, with huggingface_hub's conventions:
//! - the cache is `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`, laid out
//!   as huggingface_hub lays it out (`models--ORG--NAME/{refs,snapshots}`), so one cache serves
//!   both;
//! - `HF_TOKEN` (else the token file under `HF_HOME`) authenticates, `HF_ENDPOINT` replaces the
//!   hub's address;
//! - `HF_HUB_OFFLINE=1` uses the cache only; a revision may be a branch, a tag or a commit hash,
//!   and a commit hash resolves offline from its snapshot folder.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

pub(crate) const WEIGHTS: &str = "model.safetensors";
pub(crate) const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

/// `hf:ORG/NAME` or `hf:ORG/NAME@REVISION`.
pub fn parse_hub_id(loc: &str) -> Option<(String, Option<String>)> {
    let id = loc.strip_prefix("hf:")?;
    Some(match id.split_once('@') {
        Some((i, r)) => (i.to_string(), Some(r.to_string())),
        None => (id.to_string(), None),
    })
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

pub fn offline() -> bool {
    env("HF_HUB_OFFLINE").is_some_and(|v| v != "0" && v.to_lowercase() != "false")
}

fn hf_home() -> PathBuf {
    if let Some(home) = env("HF_HOME") {
        return PathBuf::from(home);
    }
    let cache = env("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env("HOME").unwrap_or_default()).join(".cache"));
    cache.join("huggingface")
}

/// The hub cache folder, as huggingface_hub chooses it.
pub fn cache_dir() -> PathBuf {
    env("HF_HUB_CACHE").map(PathBuf::from).unwrap_or_else(|| hf_home().join("hub"))
}

fn token() -> Option<String> {
    if let Some(t) = env("HF_TOKEN") {
        return Some(t);
    }
    let path = env("HF_TOKEN_PATH").map(PathBuf::from).unwrap_or_else(|| hf_home().join("token"));
    std::fs::read_to_string(path).ok().map(|t| t.trim().to_string()).filter(|t| !t.is_empty())
}

fn is_commit_hash(rev: &str) -> bool {
    rev.len() == 40 && rev.bytes().all(|b| b.is_ascii_hexdigit())
}

/// One repository at one revision, its files looked up in the cache and fetched into it.
pub struct HubRepo {
    pub id: String,
    pub revision: String,
    cache: PathBuf,
    /// The files the repository has at this revision, once asked (online only).
    listing: Option<Vec<String>>,
}

impl HubRepo {
    pub fn new(id: &str, revision: Option<&str>) -> HubRepo {
        HubRepo { id: id.to_string(), revision: revision.unwrap_or("main").to_string(), cache: cache_dir(), listing: None }
    }

    fn repo_dir(&self) -> PathBuf {
        self.cache.join(format!("models--{}", self.id.replace('/', "--")))
    }

    /// The commit the revision names in the cache: itself when it is a commit hash with a
    /// snapshot, else what `refs/REVISION` says.
    fn cached_commit(&self) -> Option<String> {
        if is_commit_hash(&self.revision) && self.repo_dir().join("snapshots").join(&self.revision).is_dir() {
            return Some(self.revision.clone());
        }
        std::fs::read_to_string(self.repo_dir().join("refs").join(&self.revision)).ok().map(|s| s.trim().to_string())
    }

    /// The snapshot folder of the revision in the cache, where its files are.
    pub fn snapshot(&self) -> Option<PathBuf> {
        self.cached_commit().map(|c| self.repo_dir().join("snapshots").join(c))
    }

    fn cached(&self, file: &str) -> Option<PathBuf> {
        self.snapshot().map(|s| s.join(file)).filter(|p| p.is_file())
    }

    fn api(&self) -> Result<hf_hub::api::sync::ApiRepo> {
        let mut builder =
            hf_hub::api::sync::ApiBuilder::from_cache(hf_hub::Cache::new(self.cache.clone())).with_progress(false).with_token(token());
        if let Some(endpoint) = env("HF_ENDPOINT") {
            builder = builder.with_endpoint(endpoint);
        }
        let api = builder.build().context("starting the Hugging Face hub client")?;
        Ok(api.repo(hf_hub::Repo::with_revision(self.id.clone(), hf_hub::RepoType::Model, self.revision.clone())))
    }

    /// `file` of the repository: from the cache, else downloaded into it. `None` when the
    /// repository has no such file (or, offline, the cache has not).
    pub fn fetch(&mut self, file: &str) -> Result<Option<PathBuf>> {
        if let Some(p) = self.cached(file) {
            return Ok(Some(p));
        }
        if offline() {
            return Ok(None);
        }
        if self.listing.is_none() {
            let info = self.api()?.info().map_err(|e| {
                anyhow!("hf:{}@{}: cannot list the repository: {e} (no network? set HF_HUB_OFFLINE=1 to use the cache only; a private or gated repository needs HF_TOKEN)", self.id, self.revision)
            })?;
            self.listing = Some(info.siblings.into_iter().map(|s| s.rfilename).collect());
        }
        if !self.listing.as_ref().is_some_and(|l| l.iter().any(|f| f == file)) {
            return Ok(None);
        }
        let path = self.api()?.get(file).map_err(|e| anyhow!("hf:{}@{}: cannot fetch {file}: {e}", self.id, self.revision))?;
        Ok(Some(path))
    }

    /// The error for a repository none of whose files says what it is.
    pub fn not_found(&self, wanted: &[&str]) -> anyhow::Error {
        if offline() {
            anyhow!(
                "hf:{}@{}: none of {wanted:?} is in the Hugging Face cache ({}) and HF_HUB_OFFLINE is set; download the repository where there is network (`hf download {}`) and copy the cache, or point HF_HUB_CACHE at it",
                self.id,
                self.revision,
                self.cache.display(),
                self.id
            )
        } else {
            anyhow!("hf:{}@{}: the repository has none of {wanted:?}", self.id, self.revision)
        }
    }
}

pub(crate) fn shard_files(index: &Path) -> Result<Vec<String>> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(index).with_context(|| format!("reading {}", index.display()))?)
        .with_context(|| format!("parsing {}", index.display()))?;
    let map = v.get("weight_map").and_then(Value::as_object).ok_or_else(|| anyhow!("{} has no weight_map", index.display()))?;
    let mut files: Vec<String> = map.values().filter_map(Value::as_str).map(String::from).collect();
    files.sort();
    files.dedup();
    for f in &files {
        if f.contains("..") || f.starts_with('/') {
            bail!("{}: shard name {f:?} leaves the model directory", index.display());
        }
    }
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

    /// A cache laid out as huggingface_hub writes it, found through each of its variables, by
    /// branch and by commit hash, with nothing fetched.
    #[test]
    fn the_cache_resolves_offline_by_branch_and_commit_through_each_variable() {
        let root = tempfile::tempdir().unwrap();
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let repo = root.path().join("hub/models--org--m");
        std::fs::create_dir_all(repo.join("snapshots").join(commit)).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), commit).unwrap();
        std::fs::write(repo.join("snapshots").join(commit).join("config.json"), "{}").unwrap();
        std::env::set_var("HF_HUB_OFFLINE", "1");
        std::env::remove_var("HF_HUB_CACHE");
        std::env::set_var("HF_HOME", root.path());
        let want = repo.join("snapshots").join(commit).join("config.json");
        assert_eq!(HubRepo::new("org/m", None).fetch("config.json").unwrap(), Some(want.clone()));
        assert_eq!(HubRepo::new("org/m", Some(commit)).fetch("config.json").unwrap(), Some(want.clone()));
        assert_eq!(HubRepo::new("org/m", None).fetch("absent.json").unwrap(), None);
        std::env::set_var("HF_HOME", "/nonexistent");
        std::env::set_var("HF_HUB_CACHE", root.path().join("hub"));
        assert_eq!(HubRepo::new("org/m", Some(commit)).fetch("config.json").unwrap(), Some(want));
        let err = HubRepo::new("org/other", None).not_found(&["config.json"]).to_string();
        assert!(err.contains("HF_HUB_OFFLINE") && err.contains("hf download org/other"), "{err}");
        std::env::remove_var("HF_HUB_CACHE");
        std::env::remove_var("HF_HOME");
        std::env::remove_var("HF_HUB_OFFLINE");
    }
}
