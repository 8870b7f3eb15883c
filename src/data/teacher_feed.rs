//! What the training loader hands a distillation teacher with each sample, in the batch's row
//! order: the sample through the teacher's own evaluation preprocessing and tokenizer (an online
//! teacher), or the teacher's stored embeddings of it (the score files `align data score
//! --embeddings` writes, one per shard, read a shard at a time by the worker reading it).
//!
//! A stored embedding is used only for the key and caption it was computed on; a sample without
//! one is skipped and counted (`no_teacher_embedding`, `teacher_other_caption`), never trained
//! against another sample's teacher.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use super::batch::{ImageLayout, TeacherRows};
use super::curate::scores;
use super::sample::Rejected;
use super::skips::reason;
use super::tokenizer::TextTokenizer;
use super::transform::{decode, eval_transform, ImageConfig, FULL_RESOLUTION};
use crate::util::log;

/// Where a batch's teacher rows come from.
#[derive(Clone)]
pub enum TeacherFeed {
    /// An online teacher: its preprocessing and tokenizer.
    Online { image: ImageConfig, tokenizer: Arc<TextTokenizer> },
    /// Stored embeddings: a folder of score files with embeddings.
    Stored { dir: PathBuf },
}

impl std::fmt::Debug for TeacherFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TeacherFeed::Online { image, tokenizer } => write!(f, "online teacher ({image:?}, {} tokens)", tokenizer.max_len()),
            TeacherFeed::Stored { dir } => write!(f, "stored embeddings in {}", dir.display()),
        }
    }
}

impl TeacherRows {
    fn empty(feed: &TeacherFeed, dim: usize) -> Self {
        match feed {
            TeacherFeed::Online { image, tokenizer } => TeacherRows::Inputs {
                images: Vec::new(),
                image: ImageLayout::of(image),
                ids: Vec::new(),
                mask: Vec::new(),
                max_len: tokenizer.max_len(),
            },
            TeacherFeed::Stored { .. } => TeacherRows::Embeddings { image: Vec::new(), text: Vec::new(), dim },
        }
    }
}

/// One stored shard's embeddings by key, with the place in the worker's stream it was read for.
struct StoredShard {
    epoch: u64,
    cursor: usize,
    by_key: HashMap<String, usize>,
    captions: Vec<u64>,
    image: Vec<f32>,
    text: Vec<f32>,
    dim: usize,
}

/// One sample's teacher rows, prepared before the sample enters the batch, so that a sample
/// the teacher cannot take leaves the batch as it was.
pub struct TeacherSample {
    image: Vec<f32>,
    ids: Vec<u32>,
    mask: Vec<u32>,
    text: Vec<f32>,
}

/// A loader worker's side of the feed.
pub struct TeacherSide {
    feed: Arc<TeacherFeed>,
    /// The stored shards whose samples may still leave the shuffle buffer: it mixes the end of
    /// one shard with the start of the next, so each is read once, not once per switch.
    stored: Vec<StoredShard>,
    rows: Option<TeacherRows>,
}

/// Where a sample sits in a worker's stream, for the stored shards kept in memory: its epoch,
/// its shard position, and the earliest shard position any sample still buffered comes from.
#[derive(Debug, Clone, Copy)]
pub struct StreamAt {
    pub epoch: u64,
    pub cursor: usize,
    pub oldest_live: usize,
}

impl TeacherSide {
    pub fn new(feed: Arc<TeacherFeed>) -> Self {
        TeacherSide { feed, stored: Vec::new(), rows: None }
    }

    /// The teacher's rows of a sample at `at` of the shard named `name`, from its image file's
    /// `bytes`, or why it cannot have any. An online teacher decodes the image itself, at full
    /// resolution as `align data score` does, so that the student's pixels do not depend on
    /// whether its teacher is online.
    pub fn prepare(&mut self, at: StreamAt, name: &str, key: &str, caption: &str, bytes: &[u8]) -> Result<TeacherSample, Rejected> {
        match &*self.feed {
            TeacherFeed::Online { image, tokenizer } => {
                let img = decode(bytes, FULL_RESOLUTION, image.max_pixels, image.alpha)
                    .map_err(|e| Rejected { reason: e.reason, detail: format!("the teacher's view: {}", e.detail) })?;
                let mut row = vec![0.0f32; image.numel()];
                eval_transform(&img, image, &mut row);
                let (mut ids, mut mask) = (Vec::new(), Vec::new());
                tokenizer
                    .encode_into(caption, &mut ids, &mut mask)
                    .map_err(|e| Rejected { reason: reason::CAPTION_NOT_UTF8, detail: format!("the teacher's tokenizer: {e}") })?;
                Ok(TeacherSample { image: row, ids, mask, text: Vec::new() })
            }
            TeacherFeed::Stored { dir } => {
                // A buffer draws only from its own epoch, and never again from a shard position
                // before its oldest sample's.
                let live = at.oldest_live.min(at.cursor);
                self.stored.retain(|s| s.epoch == at.epoch && s.cursor >= live);
                let i = match self.stored.iter().position(|s| s.cursor == at.cursor) {
                    Some(i) => i,
                    None => {
                        self.stored.push(load_stored(dir, at, name));
                        self.stored.len() - 1
                    }
                };
                let s = &self.stored[i];
                let Some(&row) = s.by_key.get(key) else {
                    return Err(Rejected {
                        reason: reason::NO_TEACHER_EMBEDDING,
                        detail: format!("no teacher embedding in {}", dir.display()),
                    });
                };
                if s.captions[row] != scores::caption_fingerprint(caption) {
                    return Err(Rejected {
                        reason: reason::TEACHER_OTHER_CAPTION,
                        detail: format!("the teacher embedded another caption for this key ({})", dir.display()),
                    });
                }
                let d = s.dim;
                Ok(TeacherSample {
                    image: s.image[row * d..(row + 1) * d].to_vec(),
                    text: s.text[row * d..(row + 1) * d].to_vec(),
                    ids: Vec::new(),
                    mask: Vec::new(),
                })
            }
        }
    }

    /// Appends a prepared sample's rows (after the sample entered the batch).
    pub fn push(&mut self, t: TeacherSample) {
        let dim = t.image.len();
        let rows = self.rows.get_or_insert_with(|| TeacherRows::empty(&self.feed, dim));
        match rows {
            TeacherRows::Inputs { images, ids, mask, .. } => {
                images.extend_from_slice(&t.image);
                ids.extend_from_slice(&t.ids);
                mask.extend_from_slice(&t.mask);
            }
            TeacherRows::Embeddings { image, text, .. } => {
                image.extend_from_slice(&t.image);
                text.extend_from_slice(&t.text);
            }
        }
    }

    /// The rows of the batch just formed.
    pub fn take(&mut self) -> Option<TeacherRows> {
        self.rows.take()
    }
}

/// Shard `shard`'s stored embeddings; none (every sample then skipped and counted) when its file
/// is missing or unreadable, which a warning names.
fn load_stored(dir: &std::path::Path, at: StreamAt, name: &str) -> StoredShard {
    let path = scores::score_path(dir, name);
    let mut out = StoredShard {
        epoch: at.epoch,
        cursor: at.cursor,
        by_key: HashMap::new(),
        captions: Vec::new(),
        image: Vec::new(),
        text: Vec::new(),
        dim: 0,
    };
    match scores::read(&path, true) {
        Ok(s) => {
            let (Some(image), Some(text)) = (s.image_embeddings, s.text_embeddings) else {
                log::warn(format!("{}: no embeddings (score with --embeddings); the samples of {name} are skipped", path.display()));
                return out;
            };
            let n = s.keys.len();
            if s.dim == 0 || image.len() != n * s.dim || text.len() != n * s.dim || s.captions.len() != n {
                log::warn(format!(
                    "{}: {n} keys, {} captions and {} / {} embedding values of width {}, which do not agree; the samples of {name} are skipped",
                    path.display(),
                    s.captions.len(),
                    image.len(),
                    text.len(),
                    s.dim
                ));
                return out;
            }
            out.by_key = s.keys.into_iter().enumerate().map(|(i, k)| (k, i)).collect();
            out.captions = s.captions.iter().map(|c| scores::caption_fingerprint(c)).collect();
            (out.image, out.text, out.dim) = (image, text, s.dim);
        }
        Err(e) => log::warn(format!("{e:#}; the samples of {name} are skipped (no teacher embeddings)")),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::curate::scores::ShardScores;

    fn write(dir: &std::path::Path, name: &str, keys: &[&str], base: f32, embeddings: bool) {
        let (n, dim) = (keys.len(), 2);
        let s = ShardScores {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            captions: keys.iter().map(|k| format!("caption of {k}")).collect(),
            scores: vec![0.5; n],
            image_embeddings: embeddings.then(|| (0..n * dim).map(|i| base + i as f32).collect()),
            text_embeddings: embeddings.then(|| (0..n * dim).map(|i| -(base + i as f32)).collect()),
            dim,
            meta: vec![("embeddings".into(), "true".into())],
        };
        scores::write(&scores::score_path(dir, name), &s).unwrap();
    }

    fn at(cursor: usize, oldest_live: usize) -> StreamAt {
        StreamAt { epoch: 0, cursor, oldest_live }
    }

    /// Samples of two shards mixed by the shuffle buffer get their own shard's rows, each file
    /// read once while its samples can still come; a caption other than the one embedded, a
    /// missing key, a file without embeddings and a missing file are refused with their reasons.
    #[test]
    fn stored_rows_come_from_their_own_shard_and_caption() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "a.tar", &["a0", "a1"], 100.0, true);
        write(dir.path(), "b.tar", &["b0"], 200.0, true);
        write(dir.path(), "bare.tar", &["c0", "c1"], 0.0, false);
        let mut side = TeacherSide::new(Arc::new(TeacherFeed::Stored { dir: dir.path().to_path_buf() }));
        let get =
            |side: &mut TeacherSide, at: StreamAt, name: &str, key: &str| side.prepare(at, name, key, &format!("caption of {key}"), &[]);
        let a1 = get(&mut side, at(0, 0), "a.tar", "a1").unwrap();
        assert_eq!((a1.image, a1.text), (vec![102.0, 103.0], vec![-102.0, -103.0]));
        assert_eq!(get(&mut side, at(1, 0), "b.tar", "b0").unwrap().image, vec![200.0, 201.0]);
        assert_eq!(get(&mut side, at(0, 0), "a.tar", "a0").unwrap().image, vec![100.0, 101.0]);
        assert_eq!(side.stored.len(), 2, "both shards stay while the buffer holds samples of each");
        get(&mut side, at(1, 1), "b.tar", "b0").unwrap();
        assert_eq!(side.stored.iter().map(|s| s.cursor).collect::<Vec<_>>(), [1], "shard 0 is gone once no buffered sample comes from it");
        let other = side.prepare(at(1, 1), "b.tar", "b0", "another caption", &[]).err().unwrap();
        assert_eq!(other.reason, reason::TEACHER_OTHER_CAPTION);
        assert_eq!(get(&mut side, at(1, 1), "b.tar", "zz").err().unwrap().reason, reason::NO_TEACHER_EMBEDDING);
        assert_eq!(get(&mut side, at(2, 2), "bare.tar", "c0").err().unwrap().reason, reason::NO_TEACHER_EMBEDDING);
        assert_eq!(get(&mut side, at(3, 3), "none.tar", "d0").err().unwrap().reason, reason::NO_TEACHER_EMBEDDING);
    }
}
