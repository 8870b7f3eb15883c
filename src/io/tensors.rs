//! Tensors files: safetensors read and written durably, and a model's variables matched to a
//! file's tensors by name and shape.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use candle_nn::VarMap;

/// Tensors a checkpoint may carry that no model of align has a place for: BatchNorm batch
/// counters, BERT's and ViT's poolers (ALIGN embeds the raw [CLS] state; the pooler gives
/// unrelated embeddings), and position-id buffers.
pub fn is_unused_tensor(name: &str) -> bool {
    name.ends_with("num_batches_tracked")
        || name.contains("pooler.")
        || name.ends_with("position_ids")
        || name.ends_with("embeddings.token_type_ids")
}

/// Writes `bytes` to `path` and syncs the file.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes).and_then(|()| f.sync_all()).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

pub use crate::util::files::{temporary_beside, write_atomic};

/// Syncs a directory so that renames inside it are durable.
pub fn sync_dir(dir: &Path) {
    // Directory fsync makes the rename durable; not every filesystem allows it, so ignore errors.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Writes tensors as safetensors, readable as any file the process creates (the safetensors crate
/// writes through a private temporary file, which would leave it readable by its owner only).
pub fn write_tensors(map: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    let tmp = temporary_beside(path)?;
    let written = candle_core::safetensors::save(map, &tmp)
        .with_context(|| format!("writing {}", path.display()))
        .and_then(|()| set_default_mode(&tmp))
        .and_then(|()| std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display())));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Writes tensors as safetensors and syncs the file.
pub fn save_tensors(map: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    write_tensors(map, path)?;
    File::open(path).and_then(|f| f.sync_all()).with_context(|| format!("syncing {}", path.display()))
}

/// Gives `path` the mode a newly created file gets: 0666 less the process's umask (0644 with the
/// usual 022), as `torch.save` and `std::fs::write` leave theirs.
fn set_default_mode(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    // Linux reports the umask in /proc; reading it there leaves the process's umask alone
    // (umask(2) can only be read by setting it, which races with other threads).
    let umask = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Umask:").and_then(|v| u32::from_str_radix(v.trim(), 8).ok())))
        .unwrap_or(0o022);
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666 & !umask))
        .with_context(|| format!("setting the permissions of {}", path.display()))
}

/// Every tensor of a safetensors file, read one tensor at a time: memory holds the tensors and one
/// tensor's bytes, never the whole file beside them (a 600 MB checkpoint read whole peaked at twice
/// its size). The header's offsets are checked against the file before anything is read.
pub fn read_tensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    read_each(path, device, &|_| true).with_context(|| format!("reading {}", path.display()))
}

/// The tensors of a safetensors file whose names `keep` accepts (the others' bytes are not read).
pub fn read_tensors_where(path: &Path, device: &Device, keep: &dyn Fn(&str) -> bool) -> Result<HashMap<String, Tensor>> {
    read_each(path, device, keep).with_context(|| format!("reading {}", path.display()))
}

fn read_each(path: &Path, device: &Device, keep: &dyn Fn(&str) -> bool) -> Result<HashMap<String, Tensor>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = File::open(path)?;
    let size = f.metadata()?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).context("too short to be a safetensors file")?;
    let n = u64::from_le_bytes(len);
    if n > size.saturating_sub(8) || n > 100 << 20 {
        bail!("the header claims {n} bytes, more than the file holds");
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)?;
    let json: serde_json::Value = serde_json::from_slice(&header).context("the header is not JSON")?;
    let entries = json.as_object().context("the header is not an object")?;
    let data_start = 8 + n;
    check_offsets(entries)?;
    let mut out = HashMap::with_capacity(entries.len());
    let mut bytes = Vec::new();
    for (name, e) in entries {
        if name == "__metadata__" || !keep(name) {
            continue;
        }
        let field = |k: &str| e.get(k).with_context(|| format!("tensor {name} has no {k}"));
        let dtype = match field("dtype")?.as_str().unwrap_or("") {
            "F32" => candle_core::DType::F32,
            "F16" => candle_core::DType::F16,
            "BF16" => candle_core::DType::BF16,
            "F64" => candle_core::DType::F64,
            "I64" => candle_core::DType::I64,
            "I32" => candle_core::DType::I32,
            "I16" => candle_core::DType::I16,
            "U32" => candle_core::DType::U32,
            "U8" => candle_core::DType::U8,
            other => bail!("tensor {name} has dtype {other:?}, which align does not read"),
        };
        let shape: Vec<usize> = field("shape")?
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
            .with_context(|| format!("tensor {name} has no valid shape"))?;
        let offsets: Vec<u64> = field("data_offsets")?
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_u64()).collect())
            .with_context(|| format!("tensor {name} has no valid data_offsets"))?;
        let [begin, end] = offsets[..] else { bail!("tensor {name} has no valid data_offsets") };
        let want = shape.iter().try_fold(dtype.size_in_bytes() as u64, |acc, &d| acc.checked_mul(d as u64));
        if end < begin || data_start + end > size || want != Some(end - begin) {
            bail!("tensor {name}: its data ({begin}..{end}) does not fit its shape {shape:?} or the file");
        }
        bytes.resize((end - begin) as usize, 0);
        f.seek(SeekFrom::Start(data_start + begin))?;
        f.read_exact(&mut bytes)?;
        out.insert(name.clone(), Tensor::from_raw_buffer(&bytes, dtype, &shape, device)?);
    }
    Ok(out)
}

/// Two tensors whose data overlap are one damaged or crafted file: each would read the other's
/// bytes. (The format lays tensors end to end.)
fn check_offsets(entries: &serde_json::Map<String, serde_json::Value>) -> Result<()> {
    let mut spans: Vec<(u64, u64, &str)> = entries
        .iter()
        .filter(|(name, _)| *name != "__metadata__")
        .filter_map(|(name, e)| {
            let o = e.get("data_offsets")?.as_array()?;
            Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?, name.as_str()))
        })
        .collect();
    spans.sort();
    for w in spans.windows(2) {
        let ((b0, e0, a), (b1, _, b)) = (w[0], w[1]);
        if b1 < e0 && e0 > b0 {
            bail!("tensors {a} ({b0}..{e0}) and {b} (from {b1}) overlap in the file: it is damaged");
        }
    }
    Ok(())
}

/// The name and shape of every tensor of a safetensors file, from its header alone: the 8-byte
/// length and the JSON that follows it, checked against the file's size before it is read.
pub fn header_shapes(path: &Path) -> Result<HashMap<String, Vec<usize>>> {
    use std::io::Read;
    let mut f = File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let size = f.metadata()?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).with_context(|| format!("{} is too short to be a safetensors file", path.display()))?;
    let n = u64::from_le_bytes(len);
    if n > size.saturating_sub(8) || n > 100 << 20 {
        bail!("{}: the safetensors header claims {n} bytes, more than the file holds", path.display());
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)?;
    let json: serde_json::Value =
        serde_json::from_slice(&header).with_context(|| format!("{}: the safetensors header is not JSON", path.display()))?;
    let map = json.as_object().with_context(|| format!("{}: the safetensors header is not an object", path.display()))?;
    let mut out = HashMap::new();
    for (name, entry) in map {
        if name == "__metadata__" {
            continue;
        }
        let shape = entry
            .get("shape")
            .and_then(serde_json::Value::as_array)
            .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect::<Option<Vec<usize>>>())
            .with_context(|| format!("{}: tensor {name} has no shape in the header", path.display()))?;
        out.insert(name.clone(), shape);
    }
    Ok(out)
}

/// A tensor that is to become a model parameter: floating point (an integer tensor in a weights
/// file is damage or another kind of buffer, and casting it would load nonsense without a word),
/// and, for the scalars (the logit scale and bias, the temperature), finite: a single infinite
/// value there makes every score infinite.
pub fn check_weight(name: &str, t: &Tensor, origin: &str) -> Result<()> {
    use candle_core::DType;
    if !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
        bail!("{origin}: tensor {name} holds {:?} integers where the model has floating-point weights: the file is damaged or not this model's", t.dtype());
    }
    if t.elem_count() == 1 {
        let v = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?[0];
        if !v.is_finite() {
            bail!(
                "{origin}: tensor {name} is {v}: a model's scale or bias must be finite (the checkpoint was saved after training diverged)"
            );
        }
    }
    Ok(())
}

/// The variables of a model by name, for saving.
pub fn var_tensors(vm: &VarMap) -> HashMap<String, Tensor> {
    vm.data().lock().unwrap().iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect()
}

/// Sets every variable of `vm` from `tensors`, requiring an exact match of names and shapes:
/// missing, unexpected and mis-shaped tensors are listed in the error.
pub fn load_strict(vm: &VarMap, tensors: &HashMap<String, Tensor>, origin: &Path) -> Result<()> {
    let data = vm.data().lock().unwrap();
    let mut missing: Vec<&str> = Vec::new();
    let mut shapes: Vec<String> = Vec::new();
    for (name, var) in data.iter() {
        match tensors.get(name) {
            None => missing.push(name),
            Some(t) if t.dims() != var.dims() => shapes.push(format!("{name}: checkpoint {:?}, model {:?}", t.dims(), var.dims())),
            Some(_) => {}
        }
    }
    let mut unexpected: Vec<&str> = tensors.keys().filter(|k| !data.contains_key(*k)).map(String::as_str).collect();
    if !missing.is_empty() || !shapes.is_empty() || !unexpected.is_empty() {
        missing.sort();
        unexpected.sort();
        shapes.sort();
        bail!(
            "{} does not match the model: missing {:?}; unexpected {:?}; wrong shape {:?}",
            origin.display(),
            missing,
            unexpected,
            shapes
        );
    }
    for (name, var) in data.iter() {
        let t = &tensors[name];
        check_weight(name, t, &origin.display().to_string())?;
        var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_tensors_are_readable_like_any_new_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let mut t = HashMap::new();
        t.insert("x".to_string(), Tensor::ones(2, candle_core::DType::F32, &Device::Cpu).unwrap());
        save_tensors(&t, &path).unwrap();
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"x").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), mode(&plain));
    }

    /// Read tensor by tensor, a file gives what candle's whole-file reader gives, and a file
    /// whose header points past its end is refused by name.
    #[test]
    fn tensors_read_one_by_one_equal_the_whole_file_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let dev = Device::Cpu;
        let mut t = HashMap::new();
        t.insert("a".to_string(), Tensor::arange(0f32, 12.0, &dev).unwrap().reshape((3, 4)).unwrap());
        t.insert("b".to_string(), Tensor::new(&[7i64, -1], &dev).unwrap());
        t.insert("c".to_string(), Tensor::new(2.5f32, &dev).unwrap().to_dtype(candle_core::DType::BF16).unwrap());
        save_tensors(&t, &path).unwrap();
        let ours = read_tensors(&path, &dev).unwrap();
        let theirs = candle_core::safetensors::load(&path, &dev).unwrap();
        assert_eq!(ours.len(), 3);
        for (k, v) in &theirs {
            assert_eq!((ours[k].dims(), ours[k].dtype()), (v.dims(), v.dtype()), "{k}");
            let flat = |x: &Tensor| x.to_dtype(candle_core::DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            assert_eq!(flat(&ours[k]), flat(v), "{k}");
        }
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
        let err = format!("{:#}", read_tensors(&path, &dev).unwrap_err());
        assert!(err.contains("t.safetensors") && err.contains("does not fit"), "{err}");
    }

    #[test]
    fn strict_loading_lists_every_mismatch() {
        let vm = VarMap::new();
        let dev = Device::Cpu;
        vm.get((2, 2), "a", candle_nn::Init::Const(0.0), candle_core::DType::F32, &dev).unwrap();
        vm.get(3, "b", candle_nn::Init::Const(0.0), candle_core::DType::F32, &dev).unwrap();
        let mut t = HashMap::new();
        t.insert("a".to_string(), Tensor::ones((2, 3), candle_core::DType::F32, &dev).unwrap());
        t.insert("c".to_string(), Tensor::ones(1, candle_core::DType::F32, &dev).unwrap());
        let err = load_strict(&vm, &t, Path::new("x.safetensors")).unwrap_err().to_string();
        assert!(
            err.contains("missing [\"b\"]") && err.contains("unexpected [\"c\"]") && err.contains("a: checkpoint [2, 3], model [2, 2]"),
            "{err}"
        );
    }
}
