//! Streaming a tar shard into webdataset samples.
//!
//! Members are read in order and never extracted to disk. Consecutive members that share a key
//! form one sample, exactly as webdataset's `group_by_keys` does: for a member path, the key is
//! everything up to the first dot of the file name (directories included) and the field is the
//! rest, lower-cased. `images/0001.seg.png` is key `images/0001`, field `seg.png`. Members without
//! a dot in the file name, directories and links are ignored. ustar, GNU long names and pax
//! headers are understood (by the `tar` crate's reader).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufReader, Read};

use super::skips::reason;
use super::spec::ShardSource;

/// One sample as it sits in the shard: raw bytes per field.
#[derive(Debug, Clone)]
pub struct RawSample {
    pub key: String,
    /// Position of the sample within its shard (0-based, counting every sample formed, good or
    /// bad), used to identify samples for exact resumption.
    pub index: u64,
    pub fields: BTreeMap<String, Vec<u8>>,
}

/// What reading a shard yields: samples, and the problems found on the way.
#[derive(Debug)]
pub enum ShardEvent {
    Sample(RawSample),
    /// A sample that cannot be used at the tar level (e.g. a repeated field).
    BadSample {
        key: String,
        index: u64,
        reason: &'static str,
        detail: String,
    },
    /// The shard cannot be read any further; nothing more comes from it.
    Failed {
        reason: &'static str,
        detail: String,
    },
}

/// Splits a member path into (key, field) the way webdataset does, or None when the file name has
/// no dot.
pub fn split_key(path: &str) -> Option<(&str, String)> {
    let name_start = path.rfind('/').map_or(0, |i| i + 1);
    let dot = path[name_start..].find('.')? + name_start;
    if dot == name_start {
        // Hidden files such as `.DS_Store` have no key.
        return None;
    }
    Some((&path[..dot], path[dot + 1..].to_lowercase()))
}

enum Input {
    File(BufReader<File>),
    Pipe(super::pipe_source::PipeReader),
}

impl Read for Input {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Input::File(f) => f.read(buf),
            Input::Pipe(p) => p.read(buf),
        }
    }
}

fn open_input(source: &ShardSource) -> io::Result<Input> {
    match source {
        ShardSource::File(path) => Ok(Input::File(BufReader::with_capacity(1 << 20, File::open(path)?))),
        ShardSource::Pipe(cmd) => Ok(Input::Pipe(super::pipe_source::PipeReader::spawn(cmd)?)),
    }
}

/// Reads every sample of a shard, calling `sink` for each event, in order. Returns after the last
/// sample or the first unrecoverable error (which is reported as a `Failed` event, not returned).
/// `sink` returns false to stop reading early.
pub fn read_shard(source: &ShardSource, mut sink: impl FnMut(ShardEvent) -> bool) {
    let input = match open_input(source) {
        Ok(i) => i,
        Err(e) => {
            sink(ShardEvent::Failed { reason: reason::UNREADABLE_SHARD, detail: format!("cannot open: {e}") });
            return;
        }
    };
    let mut archive = tar::Archive::new(input);
    let mut grouper = Grouper::default();
    let ending = read_members(&mut archive, &mut grouper, &mut sink);
    let input = archive.into_inner();
    match ending {
        Ending::Stopped => stop(input),
        // The sample being assembled when the stream broke may be missing fields: drop it.
        Ending::Broken { detail, reading } => {
            let pending_cut = match (&reading, grouper.current.as_ref()) {
                (Some(k), Some(p)) => *k == p.key,
                _ => true,
            };
            let ev = if pending_cut { grouper.pending_as_bad("sample cut off by a broken tar stream") } else { grouper.finish() };
            if let Some(ev) = ev {
                sink(ev);
            }
            let mut input = input;
            // A command that failed is why its stream broke: say so.
            let detail = match &mut input {
                Input::Pipe(p) => match p.ended() {
                    Some(status) if !status.success() => format!("{detail}; command {:?} exited with {status}", p.cmd),
                    _ => detail,
                },
                Input::File(_) => detail,
            };
            sink(ShardEvent::Failed { reason: reason::TRUNCATED_SHARD, detail });
            stop(input);
        }
        Ending::Done => finish(input, grouper, &mut sink),
    }
}

/// How a shard's stream of members ended.
enum Ending {
    /// The sink asked to stop.
    Stopped,
    /// The stream broke. `reading` is the key of the member being read when it broke inside one;
    /// a break at a header leaves it unknown.
    Broken { detail: String, reading: Option<String> },
    /// Every member was read.
    Done,
}

/// The archive's members, grouped into samples by key and handed to `sink`.
fn read_members(archive: &mut tar::Archive<Input>, grouper: &mut Grouper, sink: &mut impl FnMut(ShardEvent) -> bool) -> Ending {
    // Details quote the archive's own bytes (member names): control characters are escaped, so
    // a file that is no tar at all cannot write raw binary to the terminal.
    let broken = |detail: String, reading: Option<String>| Ending::Broken { detail: printable(&detail), reading };
    let entries = match archive.entries() {
        Ok(e) => e,
        Err(e) => return broken(e.to_string(), None),
    };
    for (headers, entry) in entries.enumerate() {
        let mut entry = match entry {
            Ok(e) => e,
            Err(e) if headers == 0 => return broken(format!("not a tar archive (its first header is not a tar header: {e})"), None),
            Err(e) => return broken(e.to_string(), None),
        };
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let path = match entry.path() {
            Ok(p) => p.to_string_lossy().into_owned(),
            Err(e) => return broken(format!("bad member name: {e}"), None),
        };
        let Some((key, field)) = split_key(&path) else {
            continue;
        };
        let key = key.to_string();
        let size = entry.size();
        let mut data = Vec::with_capacity(size.min(1 << 30) as usize);
        if let Err(e) = entry.read_to_end(&mut data) {
            return broken(format!("member {path}: {e}"), Some(key));
        }
        // The reader hands back a short member at end of input without complaint.
        if data.len() as u64 != size {
            return broken(format!("member {path} is cut off: {} of {size} bytes", data.len()), Some(key));
        }
        if let Some(ev) = grouper.push(key, field, data) {
            if !sink(ev) {
                return Ending::Stopped;
            }
        }
    }
    Ending::Done
}

/// `s` with control characters (and other unprintable ones) escaped.
fn printable(s: &str) -> String {
    s.chars().map(|c| if c.is_control() && c != ' ' { c.escape_default().to_string() } else { c.to_string() }).collect()
}

/// Ends a pipe's command early (a stopped, broken or abandoned read).
fn stop(input: Input) {
    if let Input::Pipe(p) = input {
        p.kill();
    }
}

/// After the last member: a pipe whose command failed cuts its last sample short; otherwise the
/// last sample is complete.
fn finish(input: Input, mut grouper: Grouper, sink: &mut impl FnMut(ShardEvent) -> bool) {
    if let Input::Pipe(p) = input {
        let cmd = p.cmd.clone();
        match p.wait() {
            Ok(status) if !status.success() => {
                if let Some(ev) = grouper.pending_as_bad("pipe command failed") {
                    sink(ev);
                }
                sink(ShardEvent::Failed { reason: reason::TRUNCATED_SHARD, detail: format!("command {cmd:?} exited with {status}") });
                return;
            }
            Err(e) => {
                sink(ShardEvent::Failed { reason: reason::TRUNCATED_SHARD, detail: format!("command {cmd:?}: {e}") });
                return;
            }
            _ => {}
        }
    }
    if let Some(ev) = grouper.finish() {
        sink(ev);
    }
}

/// Reads a whole shard into memory as a list of events (tests and small tools).
pub fn read_shard_events(source: &ShardSource) -> Vec<ShardEvent> {
    let mut out = Vec::new();
    read_shard(source, |ev| {
        out.push(ev);
        true
    });
    out
}

#[derive(Default)]
struct Grouper {
    current: Option<Pending>,
    next_index: u64,
}

struct Pending {
    key: String,
    index: u64,
    fields: BTreeMap<String, Vec<u8>>,
    duplicate: Option<String>,
}

impl Grouper {
    fn push(&mut self, key: String, field: String, data: Vec<u8>) -> Option<ShardEvent> {
        let mut emitted = None;
        if self.current.as_ref().is_some_and(|c| c.key != key) {
            emitted = self.finish();
        }
        let cur = self.current.get_or_insert_with(|| {
            let index = self.next_index;
            self.next_index += 1;
            Pending { key, index, fields: BTreeMap::new(), duplicate: None }
        });
        match cur.fields.entry(field) {
            std::collections::btree_map::Entry::Occupied(e) => {
                cur.duplicate.get_or_insert_with(|| e.key().clone());
            }
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert(data);
            }
        }
        emitted
    }

    fn finish(&mut self) -> Option<ShardEvent> {
        let p = self.current.take()?;
        Some(match p.duplicate {
            Some(field) => ShardEvent::BadSample {
                key: p.key,
                index: p.index,
                reason: reason::DUPLICATE_FIELD,
                detail: format!("field {field:?} appears twice"),
            },
            None => ShardEvent::Sample(RawSample { key: p.key, index: p.index, fields: p.fields }),
        })
    }

    fn pending_as_bad(&mut self, detail: &str) -> Option<ShardEvent> {
        let p = self.current.take()?;
        Some(ShardEvent::BadSample { key: p.key, index: p.index, reason: reason::INCOMPLETE_SAMPLE, detail: detail.into() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::shard_writer::ShardWriter;

    #[test]
    fn garbage_is_not_a_tar_archive_and_its_bytes_stay_out_of_the_message() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("garbage.tar");
        // Control characters, an escape sequence and invalid UTF-8 where a header would be.
        let bytes: Vec<u8> = (0..2048u32).map(|i| if i % 7 == 0 { 0x1b } else { (i * 131 % 256) as u8 }).collect();
        std::fs::write(&path, bytes).unwrap();
        let events = read_shard_events(&ShardSource::File(path));
        let [ShardEvent::Failed { detail, .. }] = &events[..] else { panic!("{} events", events.len()) };
        assert!(detail.starts_with("not a tar archive"), "{detail}");
        assert!(!detail.chars().any(|c| c.is_control()), "{detail:?}");
    }

    #[test]
    fn keys_split_at_the_first_dot_of_the_file_name() {
        assert_eq!(split_key("000123.jpg"), Some(("000123", "jpg".into())));
        assert_eq!(split_key("dir.v2/000123.seg.PNG"), Some(("dir.v2/000123", "seg.png".into())));
        assert_eq!(split_key("dir/noext"), None);
        assert_eq!(split_key("dir/.hidden"), None);
    }

    fn samples(events: &[ShardEvent]) -> Vec<(String, Vec<String>)> {
        events
            .iter()
            .filter_map(|e| match e {
                ShardEvent::Sample(s) => Some((s.key.clone(), s.fields.keys().cloned().collect())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn consecutive_members_with_one_key_form_one_sample() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.tar");
        let mut w = ShardWriter::create(&path).unwrap();
        w.write_sample("a", &[("jpg", b"1".as_slice()), ("txt", b"cap a")]).unwrap();
        w.write_sample("b", &[("TXT", b"cap b".as_slice()), ("json", b"{}")]).unwrap();
        w.finish().unwrap();
        let ev = read_shard_events(&ShardSource::File(path));
        assert_eq!(samples(&ev), vec![("a".into(), vec!["jpg".into(), "txt".into()]), ("b".into(), vec!["json".into(), "txt".into()])]);
    }

    #[test]
    fn long_names_survive_the_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("long.tar");
        let key = format!("{}/{}", "d".repeat(120), "k".repeat(150));
        let mut w = ShardWriter::create(&path).unwrap();
        w.write_sample(&key, &[("txt", b"x".as_slice())]).unwrap();
        w.finish().unwrap();
        let ev = read_shard_events(&ShardSource::File(path));
        assert_eq!(samples(&ev), vec![(key, vec!["txt".to_string()])]);
    }

    #[test]
    fn a_truncated_shard_keeps_the_complete_samples_and_reports_the_break() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.tar");
        let mut w = ShardWriter::create(&path).unwrap();
        for i in 0..4 {
            w.write_sample(&format!("k{i}"), &[("txt", vec![b'x'; 3000].as_slice())]).unwrap();
        }
        w.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        // Cut in the middle of the third member's data.
        std::fs::write(&path, &bytes[..2 * 3584 + 1000]).unwrap();
        let ev = read_shard_events(&ShardSource::File(path));
        assert_eq!(samples(&ev).len(), 2);
        assert!(matches!(ev.last(), Some(ShardEvent::Failed { reason: "truncated_shard", .. })), "{ev:?}");
    }

    #[test]
    fn a_repeated_field_makes_the_sample_bad_not_the_shard() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.tar");
        let mut w = ShardWriter::create(&path).unwrap();
        w.write_sample("a", &[("txt", b"1".as_slice()), ("txt", b"2")]).unwrap();
        w.write_sample("b", &[("txt", b"3".as_slice())]).unwrap();
        w.finish().unwrap();
        let ev = read_shard_events(&ShardSource::File(path));
        assert!(matches!(&ev[0], ShardEvent::BadSample { reason: "duplicate_field", .. }));
        assert_eq!(samples(&ev), vec![("b".into(), vec!["txt".into()])]);
    }

    #[test]
    fn pipe_sources_stream_from_a_command_and_failures_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.tar");
        let mut w = ShardWriter::create(&path).unwrap();
        w.write_sample("a", &[("txt", b"1".as_slice())]).unwrap();
        w.finish().unwrap();
        let ev = read_shard_events(&ShardSource::Pipe(format!("cat {}", path.display())));
        assert_eq!(samples(&ev).len(), 1);
        let ev = read_shard_events(&ShardSource::Pipe("exit 3".into()));
        assert!(matches!(ev.last(), Some(ShardEvent::Failed { .. })), "{ev:?}");
        // A cut tar whose command then fails: the cut and the command's status are both told.
        let cut = format!("head -c 700 {}; exit 4", path.display());
        let ev = read_shard_events(&ShardSource::Pipe(cut));
        let failed: Vec<String> =
            ev.iter().filter_map(|e| if let ShardEvent::Failed { detail, .. } = e { Some(detail.clone()) } else { None }).collect();
        assert!(failed.iter().any(|d| d.contains("exit status: 4")), "{failed:?}");
    }

    /// A command that sends nothing is abandoned after the stall timeout, with an error saying
    /// so, and its process is gone afterwards.
    #[test]
    fn a_silent_pipe_is_abandoned_and_killed() {
        super::super::pipe_source::set_stall_timeout(std::time::Duration::from_millis(600));
        // A duration no other process uses marks the command in the process table.
        let marker = format!("sleep 60.{}", std::process::id());
        let started = std::time::Instant::now();
        let ev = read_shard_events(&ShardSource::Pipe(marker.clone()));
        super::super::pipe_source::set_stall_timeout(std::time::Duration::from_secs(300));
        assert!(started.elapsed() < std::time::Duration::from_secs(10), "took {:?}", started.elapsed());
        assert!(matches!(ev.last(), Some(ShardEvent::Failed { detail, .. }) if detail.contains("sent nothing")), "{ev:?}");
        let ps = std::process::Command::new("ps").args(["-eo", "args"]).output().unwrap();
        assert!(!String::from_utf8_lossy(&ps.stdout).lines().any(|l| l.trim() == marker), "the stalled command still runs");
    }
}
