//! TensorBoard event files, written by hand: TFRecord framing (length, masked CRC-32C of the
//! length, payload, masked CRC-32C of the payload) around `tensorflow.Event` protobuf messages
//! (scalars as `Summary.Value.simple_value`, text through the text plugin). The JSONL metrics log
//! stays the source of truth; these files are derived from the same records.
//!
//! A background thread does the writing and flushing so training never waits on the disk.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Sender};
use std::thread::JoinHandle;

use anyhow::{bail, Context, Result};

// ---------------------------------------------------------------------------------------------
// CRC-32C (Castagnoli), table-driven, and TFRecord's masking.

const fn crc32c_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ 0x82f6_3b78 } else { c >> 1 };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
}

static CRC_TABLE: [u32; 256] = crc32c_table();

pub fn crc32c(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c = CRC_TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

pub fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

// ---------------------------------------------------------------------------------------------
// Protobuf encoding of the few messages we need.

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, ((field as u64) << 3) | wire as u64);
}

fn bytes_field(out: &mut Vec<u8>, field: u32, data: &[u8]) {
    key(out, field, 2);
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// `Summary.Value` holding a scalar.
fn scalar_value(tag: &str, value: f32) -> Vec<u8> {
    let mut v = Vec::new();
    bytes_field(&mut v, 1, tag.as_bytes());
    key(&mut v, 2, 5);
    v.extend_from_slice(&value.to_le_bytes());
    v
}

/// `Summary.Value` holding a string tensor for the text plugin.
fn text_value(tag: &str, text: &str) -> Vec<u8> {
    let mut plugin = Vec::new();
    bytes_field(&mut plugin, 1, b"text");
    let mut metadata = Vec::new();
    bytes_field(&mut metadata, 1, &plugin);
    let mut tensor = Vec::new();
    key(&mut tensor, 1, 0);
    varint(&mut tensor, 7); // DT_STRING
    bytes_field(&mut tensor, 2, &[]); // scalar shape
    bytes_field(&mut tensor, 8, text.as_bytes());
    let mut v = Vec::new();
    bytes_field(&mut v, 1, tag.as_bytes());
    bytes_field(&mut v, 8, &tensor);
    bytes_field(&mut v, 9, &metadata);
    v
}

fn event(wall_time: f64, step: i64, what: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut e = Vec::new();
    key(&mut e, 1, 1);
    e.extend_from_slice(&wall_time.to_le_bytes());
    key(&mut e, 2, 0);
    varint(&mut e, step as u64);
    what(&mut e);
    e
}

fn summary_event(wall_time: f64, step: i64, values: &[Vec<u8>]) -> Vec<u8> {
    event(wall_time, step, |e| {
        let mut summary = Vec::new();
        for v in values {
            bytes_field(&mut summary, 1, v);
        }
        bytes_field(e, 5, &summary);
    })
}

fn record(out: &mut impl Write, payload: &[u8]) -> std::io::Result<()> {
    let len = (payload.len() as u64).to_le_bytes();
    out.write_all(&len)?;
    out.write_all(&masked_crc(&len).to_le_bytes())?;
    out.write_all(payload)?;
    out.write_all(&masked_crc(payload).to_le_bytes())
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

enum Job {
    Record(Vec<u8>),
    Flush,
}

/// Writes `tb/events.out.tfevents.<time>.<host>` in the run directory on a background thread.
pub struct EventWriter {
    tx: Option<Sender<Job>>,
    handle: Option<JoinHandle<std::io::Result<()>>>,
    pub path: PathBuf,
}

impl EventWriter {
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let host = std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "localhost".into());
        // A resumed run starts a new file beside the old ones (TensorBoard reads them as one
        // run); never truncate one written in the same second.
        let stamp = now() as u64;
        let mut path = dir.join(format!("events.out.tfevents.{stamp}.{host}"));
        let mut n = 1;
        while path.exists() {
            path = dir.join(format!("events.out.tfevents.{stamp}.{host}.{n}"));
            n += 1;
        }
        let mut file = BufWriter::new(File::create(&path).with_context(|| format!("creating {}", path.display()))?);
        record(&mut file, &event(now(), 0, |e| bytes_field(e, 3, b"brain.Event:2")))?;
        file.flush()?;
        let (tx, rx) = channel::<Job>();
        let handle = std::thread::Builder::new().name("tensorboard".into()).spawn(move || -> std::io::Result<()> {
            for job in rx {
                match job {
                    Job::Record(r) => record(&mut file, &r)?,
                    Job::Flush => file.flush()?,
                }
            }
            file.flush()
        })?;
        Ok(EventWriter { tx: Some(tx), handle: Some(handle), path })
    }

    fn send(&self, job: Job) {
        if let Some(tx) = &self.tx {
            // A failed writer thread reports its error when the writer is closed.
            let _ = tx.send(job);
        }
    }

    pub fn scalars(&self, step: u64, values: &[(&str, f64)]) {
        let vals: Vec<Vec<u8>> = values.iter().filter(|(_, v)| v.is_finite()).map(|(t, v)| scalar_value(t, *v as f32)).collect();
        self.send(Job::Record(summary_event(now(), step as i64, &vals)));
        self.send(Job::Flush);
    }

    pub fn text(&self, step: u64, tag: &str, text: &str) {
        self.send(Job::Record(summary_event(now(), step as i64, &[text_value(tag, text)])));
        self.send(Job::Flush);
    }

    pub fn close(mut self) -> Result<()> {
        self.tx = None;
        match self.handle.take().map(|h| h.join()) {
            Some(Ok(Err(e))) => Err(e).with_context(|| format!("writing {}", self.path.display())),
            Some(Err(_)) => bail!("the TensorBoard writer thread panicked"),
            _ => Ok(()),
        }
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Reading back (tests, `align plot` on runs without a metrics log).

/// One scalar of an event file.
#[derive(Debug, Clone, PartialEq)]
pub struct Scalar {
    pub step: i64,
    pub wall_time: f64,
    pub tag: String,
    pub value: f32,
}

fn read_varint(b: &[u8], i: &mut usize) -> Result<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let Some(&byte) = b.get(*i) else { bail!("truncated varint") };
        *i += 1;
        v |= ((byte & 0x7f) as u64) << shift;
        if byte < 0x80 {
            return Ok(v);
        }
    }
    bail!("varint too long")
}

/// Iterates (field, wire type, payload) over a protobuf message; payloads of fixed-size and varint
/// fields are their raw bytes.
fn fields(b: &[u8]) -> Result<Vec<(u32, u8, &[u8])>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let k = read_varint(b, &mut i)?;
        let (field, wire) = ((k >> 3) as u32, (k & 7) as u8);
        let start = i;
        let len = match wire {
            0 => {
                read_varint(b, &mut i)?;
                i - start
            }
            1 => 8,
            5 => 4,
            2 => {
                let l = read_varint(b, &mut i)? as usize;
                out.push((field, wire, b.get(i..i + l).context("truncated field")?));
                i += l;
                continue;
            }
            w => bail!("unsupported wire type {w}"),
        };
        i = start + len;
        out.push((field, wire, b.get(start..i).context("truncated field")?));
    }
    Ok(out)
}

/// Every scalar in an event file, checking both CRCs of every record.
pub fn read_scalars(path: &Path) -> Result<Vec<Scalar>> {
    let mut data = Vec::new();
    File::open(path).with_context(|| format!("opening {}", path.display()))?.read_to_end(&mut data)?;
    let mut out = Vec::new();
    let mut i = 0;
    while i < data.len() {
        let header = data.get(i..i + 12).context("truncated record header")?;
        let len = u64::from_le_bytes(header[..8].try_into().unwrap()) as usize;
        if u32::from_le_bytes(header[8..12].try_into().unwrap()) != masked_crc(&header[..8]) {
            bail!("{}: bad length CRC at byte {i}", path.display());
        }
        let payload = data.get(i + 12..i + 12 + len).context("truncated record")?;
        let crc = data.get(i + 12 + len..i + 16 + len).context("truncated record CRC")?;
        if u32::from_le_bytes(crc.try_into().unwrap()) != masked_crc(payload) {
            bail!("{}: bad payload CRC at byte {i}", path.display());
        }
        i += 16 + len;
        let (mut wall, mut step) = (0.0, 0i64);
        for (f, _, v) in fields(payload)? {
            match f {
                1 => wall = f64::from_le_bytes(v.try_into()?),
                2 => step = read_varint(v, &mut 0)? as i64,
                5 => {
                    for (vf, _, value) in fields(v)? {
                        if vf != 1 {
                            continue;
                        }
                        let (mut tag, mut simple) = (String::new(), None);
                        for (ff, _, x) in fields(value)? {
                            match ff {
                                1 => tag = String::from_utf8_lossy(x).into_owned(),
                                2 => simple = Some(f32::from_le_bytes(x.try_into()?)),
                                _ => {}
                            }
                        }
                        if let Some(value) = simple {
                            out.push(Scalar { step, wall_time: wall, tag, value });
                        }
                    }
                }
                _ => {}
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_published_check_values() {
        // RFC 3720 B.4 and the common "123456789" check value.
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
    }

    #[test]
    fn written_events_read_back_with_valid_crcs() {
        let dir = tempfile::tempdir().unwrap();
        let w = EventWriter::create(dir.path()).unwrap();
        w.text(0, "config", "[train]\nlr = 0.001");
        for step in 1..=3u64 {
            w.scalars(step, &[("train/loss", 5.0 / step as f64), ("train/lr", 1e-3), ("train/nan", f64::NAN)]);
        }
        let path = w.path.clone();
        w.close().unwrap();
        let s = read_scalars(&path).unwrap();
        let losses: Vec<(i64, f32)> = s.iter().filter(|x| x.tag == "train/loss").map(|x| (x.step, x.value)).collect();
        assert_eq!(losses, vec![(1, 5.0), (2, 2.5), (3, 5.0 / 3.0)]);
        assert_eq!(s.iter().filter(|x| x.tag == "train/lr").count(), 3);
        assert!(s.iter().all(|x| x.tag != "train/nan"), "non-finite values are not written");
        // A flipped byte is caught by the CRC.
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 10] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        assert!(read_scalars(&path).unwrap_err().to_string().contains("CRC"));
    }
}
