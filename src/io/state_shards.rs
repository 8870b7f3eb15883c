//! Optimizer state split over ranks (`train.shard`): inside a checkpoint, each rank's moments in
//! a safetensors file of its own (`optimizer-00001-of-00004.safetensors`, numbered from 1 as the
//! Hugging Face hub numbers shards), and `optimizer.manifest.json` naming every file with its
//! size, its xxh3 hash and the tensors it holds.
//!
//! Files hold whole named tensors (`exp_avg.NAME`, `exp_avg_sq.NAME`, as the unsharded
//! `optimizer.safetensors`), so any number of ranks reads them back: each takes the tensors it
//! owns now from whichever file holds them. A rank checks the size of every file and the hash and
//! contents of each file it reads; a manifest that does not match its files is refused, naming
//! the file and the difference.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::tensors::{header_shapes, read_tensors_where, save_tensors, write_synced};

pub const MANIFEST_FILE: &str = "optimizer.manifest.json";
const FORMAT: &str = "align-optimizer-shards/1";

/// One rank's file, as the manifest records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardFile {
    pub rank: usize,
    pub file: String,
    pub bytes: u64,
    /// xxh3-64 of the file's bytes, in hex.
    pub xxh3: String,
    pub tensors: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    /// `optimizer` or `gradients` (`train.shard` of the run that wrote it).
    pub mode: String,
    pub world_size: usize,
    pub shards: Vec<ShardFile>,
}

impl Manifest {
    pub fn new(mode: &str, mut shards: Vec<ShardFile>) -> Manifest {
        shards.sort_by_key(|s| s.rank);
        Manifest { format: FORMAT.into(), mode: mode.into(), world_size: shards.len(), shards }
    }
}

pub fn file_name(rank: usize, world: usize) -> String {
    format!("optimizer-{:05}-of-{world:05}.safetensors", rank + 1)
}

/// Writes rank `rank`'s tensors into `dir` (synced) and describes the file for the manifest.
pub fn write_shard(dir: &Path, rank: usize, world: usize, tensors: &HashMap<String, Tensor>) -> Result<ShardFile> {
    let file = file_name(rank, world);
    let path = dir.join(&file);
    save_tensors(tensors, &path)?;
    let (bytes, xxh3) = hash_file(&path)?;
    let mut names: Vec<String> = tensors.keys().cloned().collect();
    names.sort();
    Ok(ShardFile { rank, file, bytes, xxh3, tensors: names })
}

/// Writes the manifest (synced) once every file it names is in `dir` at its recorded size.
pub fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<()> {
    for s in &manifest.shards {
        let path = dir.join(&s.file);
        let len = std::fs::metadata(&path).with_context(|| format!("rank {}'s optimizer shard {}", s.rank, path.display()))?.len();
        if len != s.bytes {
            bail!("rank {}'s optimizer shard {} is {len} bytes, {} were written", s.rank, path.display(), s.bytes);
        }
    }
    write_synced(&dir.join(MANIFEST_FILE), serde_json::to_string_pretty(manifest)?.as_bytes())
}

pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST_FILE);
    let m: Manifest = serde_json::from_str(&std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?)
        .with_context(|| format!("parsing {}", path.display()))?;
    if m.format != FORMAT {
        bail!("{} is in format {:?}, which this align does not read ({FORMAT:?})", path.display(), m.format);
    }
    Ok(m)
}

/// The tensors named in `wanted` from the sharded state in `dir`, after checking the manifest
/// against its files. Names the manifest does not list are left out (the optimizer reports them).
pub fn read(dir: &Path, device: &Device, wanted: &[String]) -> Result<HashMap<String, Tensor>> {
    let m = read_manifest(dir)?;
    let manifest = dir.join(MANIFEST_FILE);
    let mismatch = |what: String| anyhow::anyhow!("{} does not match its files: {what}", manifest.display());
    if m.shards.len() != m.world_size || m.shards.iter().enumerate().any(|(r, s)| s.rank != r) {
        return Err(mismatch(format!(
            "it lists ranks {:?} of a world of {}",
            m.shards.iter().map(|s| s.rank).collect::<Vec<_>>(),
            m.world_size
        )));
    }
    let mut seen = HashSet::new();
    for s in &m.shards {
        let path = dir.join(&s.file);
        let len = std::fs::metadata(&path).map_err(|e| mismatch(format!("{}: {e}", path.display())))?.len();
        if len != s.bytes {
            return Err(mismatch(format!("{} is {len} bytes, the manifest says {}", s.file, s.bytes)));
        }
        if let Some(dup) = s.tensors.iter().find(|t| !seen.insert(t.as_str())) {
            return Err(mismatch(format!("{dup} is listed in more than one file")));
        }
    }
    let wanted: HashSet<&str> = wanted.iter().map(String::as_str).collect();
    let mut out = HashMap::new();
    for s in m.shards.iter().filter(|s| s.tensors.iter().any(|t| wanted.contains(t.as_str()))) {
        let path = dir.join(&s.file);
        let (_, hash) = hash_file(&path)?;
        if hash != s.xxh3 {
            return Err(mismatch(format!("{} hashes to xxh3 {hash}, the manifest says {}", s.file, s.xxh3)));
        }
        let mut held: Vec<String> = header_shapes(&path)?.into_keys().collect();
        held.sort();
        let mut listed = s.tensors.clone();
        listed.sort();
        if held != listed {
            let extra: Vec<&String> = held.iter().filter(|t| !listed.contains(t)).collect();
            let missing: Vec<&String> = listed.iter().filter(|t| !held.contains(t)).collect();
            return Err(mismatch(format!(
                "{} holds {} tensors the manifest does not list and lacks {} it lists (e.g. {:?})",
                s.file,
                extra.len(),
                missing.len(),
                extra.first().or(missing.first())
            )));
        }
        out.extend(read_tensors_where(&path, device, &|name| wanted.contains(name))?);
    }
    Ok(out)
}

/// A file's length and xxh3-64 (hex), read in blocks.
fn hash_file(path: &Path) -> Result<(u64, String)> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 8 << 20];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf).with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        total += n as u64;
    }
    Ok((total, format!("{:016x}", hasher.digest())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard_of(dir: &Path, rank: usize, world: usize, names: &[&str]) -> ShardFile {
        let tensors: HashMap<String, Tensor> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.to_string(), Tensor::new(&[i as f32 + rank as f32 * 10.0, 0.5], &Device::Cpu).unwrap()))
            .collect();
        write_shard(dir, rank, world, &tensors).unwrap()
    }

    #[test]
    fn shards_read_back_by_name_and_a_manifest_that_lies_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let shards =
            vec![shard_of(dir.path(), 1, 2, &["exp_avg.b", "exp_avg_sq.b"]), shard_of(dir.path(), 0, 2, &["exp_avg.a", "exp_avg_sq.a"])];
        let m = Manifest::new("optimizer", shards);
        assert_eq!(m.shards[0].file, "optimizer-00001-of-00002.safetensors");
        write_manifest(dir.path(), &m).unwrap();
        let want = |names: &[&str]| names.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let got = read(dir.path(), &Device::Cpu, &want(&["exp_avg.a", "exp_avg_sq.b"])).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got["exp_avg_sq.b"].to_vec1::<f32>().unwrap(), vec![11.0, 0.5]);

        // A file changed after the manifest was written: same size, other bytes.
        let path = dir.path().join(&m.shards[1].file);
        let mut bytes = std::fs::read(&path).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let err = read(dir.path(), &Device::Cpu, &want(&["exp_avg.b"])).unwrap_err().to_string();
        assert!(err.contains("does not match its files") && err.contains("hashes to"), "{err}");
        // A file of another size, and a missing one.
        bytes.push(0);
        std::fs::write(&path, &bytes).unwrap();
        let err = read(dir.path(), &Device::Cpu, &want(&["exp_avg.a"])).unwrap_err().to_string();
        assert!(err.contains("bytes, the manifest says"), "{err}");
        std::fs::remove_file(&path).unwrap();
        let err = read(dir.path(), &Device::Cpu, &want(&["exp_avg.a"])).unwrap_err().to_string();
        assert!(err.contains("does not match its files") && err.contains("00002-of-00002"), "{err}");
        // A manifest listing a tensor its file does not hold.
        let mut lying = m.clone();
        lying.shards[1] = shard_of(dir.path(), 1, 2, &["exp_avg.b"]);
        lying.shards[1].tensors.push("exp_avg_sq.b".into());
        write_synced(&dir.path().join(MANIFEST_FILE), serde_json::to_string(&lying).unwrap().as_bytes()).unwrap();
        let err = read(dir.path(), &Device::Cpu, &want(&["exp_avg.b"])).unwrap_err().to_string();
        assert!(err.contains("lacks 1 it lists"), "{err}");
    }
}
