//! TensorBoard event files: TFRecord framing (length, masked CRC-32C of the length, payload,
//! masked CRC-32C of the payload) around `tensorflow.Event` protobuf messages (scalars as
//! `Summary.Value.simple_value`, text through the text plugin), the messages declared with
//! `prost` after TensorFlow's `event.proto` and `summary.proto`, the checksums from `crc32c`.
//! The JSONL metrics log stays the source of truth; these files are derived from the same records.
//!
//! A background thread does the writing and flushing so training never waits on the disk.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Sender};
use std::thread::JoinHandle;

use anyhow::{bail, Context, Result};
use prost::Message;

// ---------------------------------------------------------------------------------------------
// The messages: the fields align writes and reads, under TensorFlow's tags. `wall_time` and `step`
// have presence so that a step 0 is written as TensorFlow's writers write it.

#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, optional, tag = "1")]
    wall_time: Option<f64>,
    #[prost(int64, optional, tag = "2")]
    step: Option<i64>,
    #[prost(oneof = "EventWhat", tags = "3, 5")]
    what: Option<EventWhat>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum EventWhat {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(oneof = "ValueKind", tags = "2, 8")]
    kind: Option<ValueKind>,
    #[prost(message, optional, tag = "9")]
    metadata: Option<SummaryMetadata>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum ValueKind {
    #[prost(float, tag = "2")]
    SimpleValue(f32),
    #[prost(message, tag = "8")]
    Tensor(TensorProto),
}

#[derive(Clone, PartialEq, prost::Message)]
struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    plugin_data: Option<PluginData>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PluginData {
    #[prost(string, tag = "1")]
    plugin_name: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct TensorProto {
    /// `DT_STRING` is 7.
    #[prost(int32, tag = "1")]
    dtype: i32,
    /// Empty: a scalar.
    #[prost(message, optional, tag = "2")]
    tensor_shape: Option<TensorShape>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    string_val: Vec<Vec<u8>>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct TensorShape {}

const DT_STRING: i32 = 7;

fn scalar_value(tag: &str, value: f32) -> SummaryValue {
    SummaryValue { tag: tag.into(), kind: Some(ValueKind::SimpleValue(value)), metadata: None }
}

fn text_value(tag: &str, text: &str) -> SummaryValue {
    SummaryValue {
        tag: tag.into(),
        kind: Some(ValueKind::Tensor(TensorProto {
            dtype: DT_STRING,
            tensor_shape: Some(TensorShape {}),
            string_val: vec![text.as_bytes().to_vec()],
        })),
        metadata: Some(SummaryMetadata { plugin_data: Some(PluginData { plugin_name: "text".into() }) }),
    }
}

fn event(wall_time: f64, step: i64, what: EventWhat) -> Vec<u8> {
    Event { wall_time: Some(wall_time), step: Some(step), what: Some(what) }.encode_to_vec()
}

fn summary_event(wall_time: f64, step: i64, value: Vec<SummaryValue>) -> Vec<u8> {
    event(wall_time, step, EventWhat::Summary(Summary { value }))
}

// ---------------------------------------------------------------------------------------------
// TFRecord framing.

/// TFRecord's masked CRC-32C.
pub fn masked_crc(data: &[u8]) -> u32 {
    crc32c::crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
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
        let host = crate::util::host::name();
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
        record(&mut file, &event(now(), 0, EventWhat::FileVersion("brain.Event:2".into())))?;
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
        let vals: Vec<SummaryValue> = values.iter().filter(|(_, v)| v.is_finite()).map(|(t, v)| scalar_value(t, *v as f32)).collect();
        self.send(Job::Record(summary_event(now(), step as i64, vals)));
        self.send(Job::Flush);
    }

    pub fn text(&self, step: u64, tag: &str, text: &str) {
        self.send(Job::Record(summary_event(now(), step as i64, vec![text_value(tag, text)])));
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

/// The payloads of a TFRecord file, checking both CRCs of every record.
fn records(path: &Path, data: &[u8]) -> Result<Vec<std::ops::Range<usize>>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < data.len() {
        let header = data.get(i..i + 12).with_context(|| format!("{}: truncated record header at byte {i}", path.display()))?;
        let len = u64::from_le_bytes(header[..8].try_into().expect("8 bytes")) as usize;
        if u32::from_le_bytes(header[8..12].try_into().expect("4 bytes")) != masked_crc(&header[..8]) {
            bail!("{}: bad length CRC at byte {i}", path.display());
        }
        let end = (i + 12).checked_add(len).filter(|&e| e + 4 <= data.len());
        let Some(end) = end else { bail!("{}: truncated record at byte {i}", path.display()) };
        let crc = u32::from_le_bytes(data[end..end + 4].try_into().expect("4 bytes"));
        if crc != masked_crc(&data[i + 12..end]) {
            bail!("{}: bad payload CRC at byte {i}", path.display());
        }
        out.push(i + 12..end);
        i = end + 4;
    }
    Ok(out)
}

/// Every scalar in an event file.
pub fn read_scalars(path: &Path) -> Result<Vec<Scalar>> {
    let mut data = Vec::new();
    File::open(path).with_context(|| format!("opening {}", path.display()))?.read_to_end(&mut data)?;
    let mut out = Vec::new();
    for r in records(path, &data)? {
        let e = Event::decode(&data[r.clone()])
            .with_context(|| format!("{}: the record at byte {} is not an Event", path.display(), r.start - 12))?;
        let Some(EventWhat::Summary(s)) = e.what else { continue };
        for v in s.value {
            if let Some(ValueKind::SimpleValue(value)) = v.kind {
                out.push(Scalar { step: e.step.unwrap_or(0), wall_time: e.wall_time.unwrap_or(0.0), tag: v.tag, value });
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
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c::crc32c(&[0xffu8; 32]), 0x62a8_ab43);
    }

    /// The same events give the same bytes as the hand-written encoder this replaced
    /// (`tests/fixtures/tensorboard-events.bin`, written by it), which TensorBoard reads.
    #[test]
    fn events_are_byte_identical_to_the_earlier_files() {
        let mut out = Vec::new();
        record(&mut out, &event(1_700_000_000.25, 0, EventWhat::FileVersion("brain.Event:2".into()))).unwrap();
        record(&mut out, &summary_event(1_700_000_001.5, 0, vec![text_value("config", "[train]\nlr = 0.001\nname = \"caf\u{e9}\"")]))
            .unwrap();
        for step in [1i64, 2, 300, 70_000] {
            let vals = vec![
                scalar_value("train/loss", 5.0 / step as f32),
                scalar_value("train/lr", 1e-3),
                scalar_value("eval/zeroshot/acc1", -0.0),
            ];
            record(&mut out, &summary_event(1_700_000_002.0 + step as f64 / 8.0, step, vals)).unwrap();
        }
        record(&mut out, &summary_event(1_700_000_100.0, 70_001, vec![])).unwrap();
        let fixture = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tensorboard-events.bin")).unwrap();
        assert_eq!(out, fixture);
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
