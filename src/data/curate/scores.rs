//! Score files: one Parquet file per input shard (`SHARD.parquet`), a row per usable sample in the
//! shard's order: `key`, `caption` (the one scored), `score` (the image-text cosine) and,
//! optionally, the image and text embeddings as fixed-size lists. Parquet is what img2dataset,
//! LAION and DataComp keep their metadata in: pandas and pyarrow read these as they are. The
//! file's key-value metadata names the shard, the checkpoint and the counts, so a file that does
//! not belong to its shard is noticed.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use arrow_array::{Array, ArrayRef, FixedSizeListArray, Float32Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;

/// The scores of one shard.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ShardScores {
    pub keys: Vec<String>,
    pub captions: Vec<String>,
    pub scores: Vec<f32>,
    /// Row-major `keys.len() × dim`, when kept.
    pub image_embeddings: Option<Vec<f32>>,
    pub text_embeddings: Option<Vec<f32>>,
    pub dim: usize,
    /// The key-value metadata: `shard`, `checkpoint`, `samples`, `skipped`.
    pub meta: Vec<(String, String)>,
}

impl ShardScores {
    pub fn meta(&self, key: &str) -> Option<&str> {
        self.meta.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// The score file of a shard named `shard` (a path or `pipe:` spec) in `dir`.
pub fn score_path(dir: &Path, shard: &str) -> PathBuf {
    let name = Path::new(shard.trim_start_matches("pipe:")).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let stem = name.strip_suffix(".tar").unwrap_or(&name);
    let clean: String = stem.chars().map(|c| if c.is_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    dir.join(format!("{clean}.parquet"))
}

fn list(values: &[f32], dim: usize) -> Result<ArrayRef> {
    let item = Arc::new(Field::new("item", DataType::Float32, false));
    let arr = FixedSizeListArray::try_new(item, dim as i32, Arc::new(Float32Array::from(values.to_vec())), None)?;
    Ok(Arc::new(arr))
}

/// Writes `s` to `path` atomically (a temporary file renamed into place).
pub fn write(path: &Path, s: &ShardScores) -> Result<()> {
    let n = s.keys.len();
    if s.captions.len() != n || s.scores.len() != n {
        bail!("score rows disagree: {n} keys, {} captions, {} scores", s.captions.len(), s.scores.len());
    }
    let mut fields = vec![
        Field::new("key", DataType::Utf8, false),
        Field::new("caption", DataType::Utf8, false),
        Field::new("score", DataType::Float32, false),
    ];
    let mut columns: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from(s.keys.clone())),
        Arc::new(StringArray::from(s.captions.clone())),
        Arc::new(Float32Array::from(s.scores.clone())),
    ];
    for (name, values) in [("image_embedding", &s.image_embeddings), ("text_embedding", &s.text_embeddings)] {
        if let Some(v) = values {
            if v.len() != n * s.dim {
                bail!("{name}: {} values for {n} rows of {}", v.len(), s.dim);
            }
            let item = Arc::new(Field::new("item", DataType::Float32, false));
            fields.push(Field::new(name, DataType::FixedSizeList(item, s.dim as i32), false));
            columns.push(list(v, s.dim)?);
        }
    }
    let schema = Arc::new(Schema::new(fields));
    let batch = RecordBatch::try_new(schema.clone(), columns)?;
    let meta: Vec<KeyValue> = s.meta.iter().map(|(k, v)| KeyValue::new(format!("align.{k}"), v.clone())).collect();
    let props = WriterProperties::builder()
        .set_compression(parquet::basic::Compression::SNAPPY)
        .set_key_value_metadata(Some(meta))
        .set_created_by("align".into())
        .build();
    crate::util::files::write_atomic_with(path, |file| {
        let mut w = ArrowWriter::try_new(file.try_clone()?, schema, Some(props))?;
        w.write(&batch)?;
        w.close()?;
        Ok(())
    })
}

/// Reads a score file, with its embeddings when `embeddings` is set.
pub fn read(path: &Path, embeddings: bool) -> Result<ShardScores> {
    (|| -> Result<ShardScores> {
        let file = File::open(path)?;
        let builder = ParquetRecordBatchReaderBuilder::try_new(file)?;
        let meta = builder
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .map(|kv| {
                kv.iter()
                    .filter_map(|e| Some((e.key.strip_prefix("align.")?.to_string(), e.value.clone().unwrap_or_default())))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        let mut out = ShardScores { meta, ..Default::default() };
        for batch in builder.build()? {
            let batch = batch?;
            let column = |name: &str| batch.column_by_name(name).with_context(|| format!("no {name} column"));
            let strings = |name: &str| -> Result<Vec<String>> {
                let c = column(name)?;
                let a = c.as_any().downcast_ref::<StringArray>().with_context(|| format!("{name} is not text"))?;
                Ok((0..a.len()).map(|i| a.value(i).to_string()).collect())
            };
            out.keys.extend(strings("key")?);
            out.captions.extend(strings("caption")?);
            let scores = column("score")?;
            let scores = scores.as_any().downcast_ref::<Float32Array>().context("score is not float32")?;
            out.scores.extend(scores.values().iter().copied());
            if embeddings {
                for (name, slot) in [("image_embedding", &mut out.image_embeddings), ("text_embedding", &mut out.text_embeddings)] {
                    let Some(c) = batch.column_by_name(name) else { continue };
                    let l = c.as_any().downcast_ref::<FixedSizeListArray>().with_context(|| format!("{name} is not a list"))?;
                    out.dim = l.value_length() as usize;
                    let values = l.values().as_any().downcast_ref::<Float32Array>().with_context(|| format!("{name} is not float32"))?;
                    slot.get_or_insert_with(Vec::new).extend(values.values().iter().copied());
                }
            }
        }
        Ok(out)
    })()
    .with_context(|| format!("reading score file {}", path.display()))
}

/// Every sample's score (and image embedding, when asked and kept) from the score files of a
/// directory, by key. Keys must be unique across the files, as img2dataset makes them.
pub struct ScoreTable {
    pub by_key: HashMap<String, usize>,
    pub scores: Vec<f32>,
    pub image_embeddings: Option<Vec<f32>>,
    pub dim: usize,
    pub dir: PathBuf,
}

impl ScoreTable {
    pub fn load(dir: &Path, embeddings: bool) -> Result<ScoreTable> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("reading the score directory {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "parquet"))
            .collect();
        files.sort();
        if files.is_empty() {
            bail!("{} holds no score files (align data score writes them)", dir.display());
        }
        let mut t = ScoreTable { by_key: HashMap::new(), scores: Vec::new(), image_embeddings: None, dim: 0, dir: dir.to_path_buf() };
        for f in files {
            let s = read(&f, embeddings)?;
            if embeddings && s.image_embeddings.is_none() && !s.keys.is_empty() {
                bail!("{} holds no image embeddings: score with --embeddings for deduplication", f.display());
            }
            for key in s.keys {
                let row = t.scores.len();
                if t.by_key.insert(key.clone(), row).is_some() {
                    bail!("sample key {key:?} appears twice in the score files of {} (keys must be unique across shards)", dir.display());
                }
                t.scores.push(0.0);
            }
            let start = t.scores.len() - s.scores.len();
            t.scores[start..].copy_from_slice(&s.scores);
            if let Some(e) = s.image_embeddings {
                t.dim = s.dim;
                t.image_embeddings.get_or_insert_with(Vec::new).extend(e);
            }
        }
        Ok(t)
    }

    /// The keys in row order.
    pub fn keys(&self) -> Vec<String> {
        let mut keys = vec![String::new(); self.scores.len()];
        for (k, &i) in &self.by_key {
            keys[i] = k.clone();
        }
        keys
    }

    pub fn score(&self, key: &str) -> Option<f32> {
        self.by_key.get(key).map(|&i| self.scores[i])
    }

    /// The score above which the top `fraction` of all scored samples lie.
    pub fn quantile_threshold(&self, fraction: f64) -> f32 {
        let mut s = self.scores.clone();
        s.sort_by(|a, b| b.total_cmp(a));
        let keep = ((fraction * s.len() as f64).ceil() as usize).clamp(1, s.len().max(1));
        s.get(keep - 1).copied().unwrap_or(f32::NEG_INFINITY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_round_trip_with_their_embeddings_and_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let s = ShardScores {
            keys: vec!["a".into(), "b".into(), "c".into()],
            captions: vec!["x".into(), "y".into(), "z".into()],
            scores: vec![0.5, -0.25, 0.125],
            image_embeddings: Some((0..6).map(|i| i as f32).collect()),
            text_embeddings: Some((0..6).map(|i| -(i as f32)).collect()),
            dim: 2,
            meta: vec![("shard".into(), "s-000.tar".into()), ("samples".into(), "3".into())],
        };
        let path = score_path(dir.path(), "raw/s-000.tar");
        assert_eq!(path.file_name().unwrap(), "s-000.parquet");
        write(&path, &s).unwrap();
        assert_eq!(read(&path, true).unwrap(), s);
        let plain = read(&path, false).unwrap();
        assert_eq!((plain.scores.clone(), plain.image_embeddings), (s.scores.clone(), None));
        let t = ScoreTable::load(dir.path(), true).unwrap();
        assert_eq!((t.score("b"), t.dim, t.image_embeddings.as_ref().unwrap().len()), (Some(-0.25), 2, 6));
        // The top third of three scores is the best one; two thirds keep the two best.
        assert_eq!((t.quantile_threshold(1.0 / 3.0), t.quantile_threshold(0.5)), (0.5, 0.125));
    }
}
