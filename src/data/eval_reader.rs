//! Reading evaluation data in order: one thread streams the samples (tar members of shards, or
//! image files of a folder layout such as ImageNet's or a Karpathy split) and prepares each chunk
//! there, decoding and transforming its images in parallel straight into the chunk's one pixel
//! buffer, so that the next batch is made while the model embeds this one; chunks come out in
//! the data's order, at most one ready ahead (memory: two batches of pixels).

use std::sync::mpsc::{Receiver, SyncSender};
use std::thread::JoinHandle;

use rayon::prelude::*;

use super::sample::{self, Rejected};
use super::skips::SkipCounts;
use super::spec::ShardSource;
use super::tar_read::{read_shard, RawSample, ShardEvent};
use super::transform::{decode, decode_min_side, eval_transform, ImageConfig};
use crate::util::log;

/// What an evaluation needs from each sample; a sample lacking a needed part is skipped.
#[derive(Debug, Clone, Copy)]
pub struct Needs {
    pub image: bool,
    pub captions: bool,
    pub label: bool,
}

#[derive(Debug, Clone)]
pub struct EvalItem {
    pub key: String,
    pub captions: Vec<String>,
    pub label: Option<i64>,
}

/// A chunk of usable samples in the data's order, with their images after the eval transform
/// (`items.len() × 3 × image_size × image_size` floats, when images are needed).
#[derive(Debug, Default)]
pub struct EvalBatch {
    pub items: Vec<EvalItem>,
    pub pixels: Vec<f32>,
}

/// An image file with its label and/or captions (folder layouts, Karpathy splits).
#[derive(Debug, Clone)]
pub struct FileSample {
    pub path: std::path::PathBuf,
    pub label: Option<i64>,
    pub captions: Vec<String>,
}

pub enum EvalSource {
    Shards(Vec<ShardSource>),
    Files(Vec<FileSample>),
}

impl EvalSource {
    fn origins(&self) -> Vec<String> {
        match self {
            EvalSource::Shards(s) => s.iter().map(|s| s.to_string()).collect(),
            EvalSource::Files(_) => vec!["files".to_string()],
        }
    }
}

struct Chunk {
    samples: Vec<(usize, RawSample)>,
    skips: SkipCounts,
}

/// A chunk prepared: its batch, and what was skipped reading and preparing it.
struct Prepared {
    batch: EvalBatch,
    skips: SkipCounts,
}

/// A file as a sample: the image under its extension's field, the label as `cls`, the captions
/// as lines of `txt`, keyed by its path.
fn file_sample(f: &FileSample, index: u64) -> std::io::Result<RawSample> {
    let bytes = std::fs::read(&f.path)?;
    let ext = f.path.extension().map(|e| e.to_string_lossy().to_lowercase()).unwrap_or_else(|| "jpg".into());
    let mut fields = std::collections::BTreeMap::new();
    fields.insert(ext, bytes);
    if let Some(l) = f.label {
        fields.insert("cls".to_string(), l.to_string().into_bytes());
    }
    if !f.captions.is_empty() {
        fields.insert("txt".to_string(), f.captions.join("\n").into_bytes());
    }
    Ok(RawSample { key: f.path.display().to_string(), index, fields })
}

pub struct EvalReader {
    rx: Option<Receiver<Prepared>>,
    handle: Option<JoinHandle<()>>,
    skips: SkipCounts,
    samples: u64,
}

impl EvalReader {
    pub fn new(shards: Vec<ShardSource>, cfg: ImageConfig, needs: Needs, chunk: usize) -> Self {
        Self::from_source(EvalSource::Shards(shards), cfg, needs, chunk)
    }

    pub fn from_source(source: EvalSource, cfg: ImageConfig, needs: Needs, chunk: usize) -> Self {
        let origins = source.origins();
        let chunk = chunk.max(1);
        let spawned = super::reader_thread::spawn("eval-reader", 1, move |out: SyncSender<Prepared>| {
            let tx = Preparer { out, shards: origins, cfg, needs };
            let fresh = || Chunk { samples: Vec::with_capacity(chunk), skips: SkipCounts::default() };
            let mut cur = fresh();
            match source {
                EvalSource::Files(files) => {
                    for (i, f) in files.iter().enumerate() {
                        match file_sample(f, i as u64) {
                            Ok(s) => cur.samples.push((0, s)),
                            Err(e) => {
                                cur.skips.add(super::skips::reason::MISSING_IMAGE);
                                log::warn(format!("{}: {e}; skipped", f.path.display()));
                            }
                        }
                        if cur.samples.len() >= chunk && tx.send(std::mem::replace(&mut cur, fresh())).is_err() {
                            return;
                        }
                    }
                }
                EvalSource::Shards(list) => {
                    for (i, src) in list.iter().enumerate() {
                        let mut open = true;
                        read_shard(src, |ev| {
                            match ev {
                                ShardEvent::Sample(s) => cur.samples.push((i, s)),
                                ShardEvent::BadSample { key, reason, detail, .. } => {
                                    cur.skips.add(reason);
                                    log::warn_sample(&src.to_string(), reason, format!("shard {src}: sample {key}: {detail}; skipped"));
                                }
                                ShardEvent::Failed { reason, detail } => {
                                    cur.skips.add(reason);
                                    log::warn(format!("shard {src}: {detail}; rest of the shard skipped"));
                                }
                            }
                            if cur.samples.len() >= chunk {
                                open = tx.send(std::mem::replace(&mut cur, fresh())).is_ok();
                            }
                            open
                        });
                        if !open {
                            return;
                        }
                    }
                }
            }
            let _ = tx.send(cur);
        });
        // As std::thread::spawn does: a process that cannot start a thread has no way on.
        let (rx, handle) = spawned.expect("starting the evaluation reader thread");
        EvalReader { rx: Some(rx), handle: Some(handle), skips: SkipCounts::default(), samples: 0 }
    }

    pub fn skips(&self) -> &SkipCounts {
        &self.skips
    }

    /// Usable samples delivered so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }
}

/// Prepares chunks on the reader's thread and hands them on.
struct Preparer {
    out: SyncSender<Prepared>,
    shards: Vec<String>,
    cfg: ImageConfig,
    needs: Needs,
}

impl Preparer {
    /// Prepares `chunk` and sends it; an error means the reader was dropped.
    fn send(&self, chunk: Chunk) -> Result<(), std::sync::mpsc::SendError<Prepared>> {
        self.out.send(prepare_chunk(&self.shards, &self.cfg, self.needs, chunk))
    }
}

/// Decodes and transforms a chunk's images in parallel, each into its slot of one buffer, and
/// drops (counting them) the samples that cannot be used.
fn prepare_chunk(shards: &[String], cfg: &ImageConfig, needs: Needs, chunk: Chunk) -> Prepared {
    let per = if needs.image { cfg.numel() } else { 0 };
    let mut pixels = vec![0f32; per * chunk.samples.len()];
    let results: Vec<Result<EvalItem, Rejected>> = if per == 0 {
        chunk.samples.par_iter().map(|(i, s)| prepare(shards, cfg, needs, *i, s, &mut [])).collect()
    } else {
        chunk.samples.par_iter().zip(pixels.par_chunks_mut(per)).map(|((i, s), out)| prepare(shards, cfg, needs, *i, s, out)).collect()
    };
    let mut skips = chunk.skips;
    let mut items = Vec::with_capacity(results.len());
    for (slot, ((i, s), r)) in chunk.samples.iter().zip(results).enumerate() {
        match r {
            Ok(item) => {
                // Usable images move down over the slots of skipped ones.
                if per > 0 && items.len() != slot {
                    pixels.copy_within(slot * per..(slot + 1) * per, items.len() * per);
                }
                items.push(item);
            }
            Err(rej) => {
                skips.add(rej.reason);
                log::warn_sample(
                    &shards[*i].to_string(),
                    rej.reason,
                    format!("shard {}: sample {}: {}; skipped", shards[*i], s.key, rej.detail),
                );
            }
        }
    }
    pixels.truncate(items.len() * per);
    Prepared { batch: EvalBatch { items, pixels }, skips }
}

fn prepare(shards: &[String], cfg: &ImageConfig, needs: Needs, shard: usize, s: &RawSample, out: &mut [f32]) -> Result<EvalItem, Rejected> {
    let captions = if needs.captions { sample::captions(s)? } else { sample::captions(s).unwrap_or_default() };
    let label = sample::label(s)?;
    if needs.label && label.is_none() {
        return Err(Rejected { reason: super::skips::reason::BAD_LABEL, detail: format!("no cls field in shard {}", shards[shard]) });
    }
    if needs.image {
        let bytes = sample::image_bytes(s)?;
        let img = decode(bytes, decode_min_side(cfg, false), cfg.max_pixels, cfg.alpha)
            .map_err(|e| Rejected { reason: e.reason, detail: e.detail })?;
        eval_transform(&img, cfg, out);
    }
    Ok(EvalItem { key: s.key.clone(), captions, label })
}

impl Iterator for EvalReader {
    type Item = EvalBatch;

    fn next(&mut self) -> Option<EvalBatch> {
        loop {
            let prepared = self.rx.as_ref()?.recv().ok()?;
            self.skips.merge(&prepared.skips);
            self.samples += prepared.batch.items.len() as u64;
            if !prepared.batch.items.is_empty() {
                return Some(prepared.batch);
            }
        }
    }
}

impl Drop for EvalReader {
    fn drop(&mut self) {
        self.rx = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::shard_writer::ShardWriter;

    /// A large JPEG is evaluated from its full-resolution pixels (as transformers' processors
    /// decode it), not from the reduced DCT scale training may use.
    #[test]
    fn large_jpegs_are_evaluated_at_full_resolution() {
        let img =
            image::RgbImage::from_fn(1024, 768, |x, y| image::Rgb([(x * 7 % 256) as u8, (y * 13 % 256) as u8, ((x ^ y) % 256) as u8]));
        let mut jpeg = Vec::new();
        img.write_to(&mut std::io::Cursor::new(&mut jpeg), image::ImageFormat::Jpeg).unwrap();
        let sample = RawSample { key: "big".into(), index: 0, fields: [("jpg".to_string(), jpeg.clone())].into_iter().collect() };
        let cfg = ImageConfig { image_size: 64, resize: 72, ..Default::default() };
        let mut image = vec![0.0; cfg.numel()];
        prepare(&["s".into()], &cfg, Needs { image: true, captions: false, label: false }, 0, &sample, &mut image).unwrap();
        let at = |min_side: u32| {
            let mut out = vec![0.0; cfg.numel()];
            eval_transform(&decode(&jpeg, min_side, cfg.max_pixels, cfg.alpha).unwrap(), &cfg, &mut out);
            out
        };
        assert_eq!(image, at(super::super::transform::FULL_RESOLUTION));
        assert_ne!(image, at(cfg.resize as u32), "the reduced scale gives the same pixels here: the test shows nothing");
    }

    #[test]
    fn items_come_out_in_shard_order_with_bad_ones_counted() {
        let dir = tempfile::tempdir().unwrap();
        let mut shards = Vec::new();
        for s in 0..2 {
            let path = dir.path().join(format!("e{s}.tar"));
            let mut w = ShardWriter::create(&path).unwrap();
            for i in 0..5 {
                let img = image::RgbImage::from_pixel(4, 4, image::Rgb([i as u8, 0, 0]));
                let mut png = Vec::new();
                img.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png).unwrap();
                let png = if s == 1 && i == 2 { b"broken".to_vec() } else { png };
                w.write_sample(&format!("{s}-{i}"), &[("png", png), ("txt", format!("a\nb{i}").into_bytes())]).unwrap();
            }
            w.finish().unwrap();
            shards.push(ShardSource::File(path));
        }
        let cfg = ImageConfig { image_size: 4, resize: 4, ..Default::default() };
        let mut r = EvalReader::new(shards, cfg, Needs { image: true, captions: true, label: false }, 3);
        let batches: Vec<EvalBatch> = r.by_ref().collect();
        let items: Vec<&EvalItem> = batches.iter().flat_map(|b| &b.items).collect();
        let keys: Vec<&str> = items.iter().map(|i| i.key.as_str()).collect();
        assert_eq!(keys, ["0-0", "0-1", "0-2", "0-3", "0-4", "1-0", "1-1", "1-3", "1-4"]);
        assert_eq!(items[3].captions, vec!["a", "b3"]);
        assert_eq!(r.skips().get("corrupt_image"), 1);
        // Each batch's pixels are its usable images, in order: the skipped one's slot was closed up.
        let reds: Vec<f32> = batches.iter().flat_map(|b| b.pixels.chunks(48).map(|p| p[0])).collect();
        let want: Vec<f32> = [0, 1, 2, 3, 4, 0, 1, 3, 4].iter().map(|&i| (i as f32 / 255.0 - 0.5) / 0.5).collect();
        assert_eq!(reds.len(), 9);
        for (r, w) in reds.iter().zip(&want) {
            assert!((r - w).abs() < 1e-6, "{reds:?}");
        }
    }
}
