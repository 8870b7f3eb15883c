//! What `align data build` reads: webdataset shards (img2dataset's jpg + txt + json) or a table
//! of `caption<TAB>image path` rows (`.tsv`; `.csv` with the same two columns) with an image
//! root. Samples stream through a bounded channel from a reader thread, so memory does not grow
//! with the corpus.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender};

use anyhow::{bail, Context, Result};

use crate::data::sample;
use crate::data::spec::{self, ShardSource};
use crate::data::tar_read::{read_shard, ShardEvent};

pub enum Input {
    Shards(Vec<ShardSource>),
    Table { path: PathBuf, image_root: PathBuf, rows: Vec<(String, String)> },
}

/// One input sample, or why it cannot be one.
pub enum Item {
    Sample(Candidate),
    Bad { origin: String, key: String, reason: String },
}

pub struct Candidate {
    pub origin: String,
    pub key: String,
    pub image: Vec<u8>,
    pub caption: String,
    /// The shard's `json` field, passed through to the output.
    pub json: Option<Vec<u8>>,
}

fn is_header(caption: &str, path: &str) -> bool {
    ["caption", "text", "alt", "alt_text"].contains(&caption.trim().to_lowercase().as_str())
        && ["image", "path", "file", "filepath", "image_path"].contains(&path.trim().to_lowercase().as_str())
}

impl Input {
    pub fn open(spec_or_table: &str, image_root: Option<&Path>) -> Result<Self> {
        let lower = spec_or_table.to_lowercase();
        if lower.ends_with(".tsv") || lower.ends_with(".csv") {
            let path = PathBuf::from(spec_or_table);
            let root = image_root.map(Path::to_path_buf).unwrap_or_else(|| path.parent().unwrap_or(Path::new(".")).to_path_buf());
            let mut reader = csv::ReaderBuilder::new()
                .has_headers(false)
                .flexible(true)
                .delimiter(if lower.ends_with(".tsv") { b'\t' } else { b',' })
                .quoting(!lower.ends_with(".tsv"))
                .from_path(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            let mut rows = Vec::new();
            for (i, rec) in reader.records().enumerate() {
                let rec = rec.with_context(|| format!("{}: row {}", path.display(), i + 1))?;
                if rec.len() < 2 {
                    bail!("{}: row {} has {} column(s); expected caption and image path", path.display(), i + 1, rec.len());
                }
                if i == 0 && is_header(&rec[0], &rec[1]) {
                    continue;
                }
                rows.push((rec[0].to_string(), rec[1].to_string()));
            }
            return Ok(Input::Table { path, image_root: root, rows });
        }
        Ok(Input::Shards(spec::expand(spec_or_table)?))
    }

    /// How many shards / rows the input has (for progress).
    pub fn parts(&self) -> usize {
        match self {
            Input::Shards(s) => s.len(),
            Input::Table { rows, .. } => rows.len(),
        }
    }

    /// Streams every item in input order from a reader thread.
    pub fn stream(&self) -> Receiver<Item> {
        let produce: Box<dyn FnOnce(SyncSender<Item>) + Send> = match self {
            Input::Shards(shards) => {
                let shards = shards.clone();
                Box::new(move |tx| {
                    for src in &shards {
                        let origin = src.to_string();
                        let mut open = true;
                        read_shard(src, |ev| {
                            let item = match ev {
                                ShardEvent::Sample(s) => {
                                    let parsed =
                                        sample::image_bytes(&s).map(<[u8]>::to_vec).and_then(|img| Ok((img, sample::captions(&s)?)));
                                    match parsed {
                                        Ok((image, caps)) => Item::Sample(Candidate {
                                            origin: origin.clone(),
                                            key: s.key.clone(),
                                            image,
                                            caption: caps.join(" "),
                                            json: s.fields.get("json").cloned(),
                                        }),
                                        Err(r) => Item::Bad { origin: origin.clone(), key: s.key.clone(), reason: r.detail },
                                    }
                                }
                                ShardEvent::BadSample { key, detail, .. } => Item::Bad { origin: origin.clone(), key, reason: detail },
                                ShardEvent::Failed { detail, .. } => Item::Bad { origin: origin.clone(), key: "-".into(), reason: detail },
                            };
                            open = tx.send(item).is_ok();
                            open
                        });
                        if !open {
                            return;
                        }
                    }
                })
            }
            Input::Table { path, image_root, rows } => {
                let (path, root, rows) = (path.display().to_string(), image_root.clone(), rows.clone());
                Box::new(move |tx| {
                    let width = rows.len().max(1).to_string().len().max(9);
                    for (i, (caption, file)) in rows.into_iter().enumerate() {
                        let key = format!("{i:0width$}");
                        let item = match std::fs::read(root.join(&file)) {
                            Ok(image) if !caption.trim().is_empty() => {
                                let json = serde_json::to_vec(&serde_json::json!({"key": key, "caption": caption, "image": file})).ok();
                                Item::Sample(Candidate { origin: path.clone(), key, image, caption, json })
                            }
                            Ok(_) => Item::Bad { origin: path.clone(), key, reason: "caption is empty".into() },
                            Err(e) => Item::Bad { origin: path.clone(), key, reason: format!("image {file}: {e}") },
                        };
                        if tx.send(item).is_err() {
                            return;
                        }
                    }
                })
            }
        };
        // As std::thread::spawn does: a process that cannot start a thread has no way on.
        super::super::reader_thread::spawn("build-input", 256, produce).expect("starting the input reader thread").0
    }
}
