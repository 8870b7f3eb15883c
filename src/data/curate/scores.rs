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

/// A score file's metadata alone, without its rows.
pub fn read_meta(path: &Path) -> Result<ShardScores> {
    (|| -> Result<ShardScores> {
        let builder = ParquetRecordBatchReaderBuilder::try_new(File::open(path)?)?;
        Ok(ShardScores { meta: align_meta(builder.metadata().file_metadata().key_value_metadata()), ..Default::default() })
    })()
    .with_context(|| format!("reading score file {}", path.display()))
}

fn align_meta(kv: Option<&Vec<KeyValue>>) -> Vec<(String, String)> {
    kv.map(|kv| kv.iter().filter_map(|e| Some((e.key.strip_prefix("align.")?.to_string(), e.value.clone().unwrap_or_default()))).collect())
        .unwrap_or_default()
}

/// Reads a score file, with its embeddings when `embeddings` is set.
pub fn read(path: &Path, embeddings: bool) -> Result<ShardScores> {
    (|| -> Result<ShardScores> {
        let file = File::open(path)?;
        let builder = ParquetRecordBatchReaderBuilder::try_new(file)?;
        let meta = align_meta(builder.metadata().file_metadata().key_value_metadata());
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
            // A null score (a file written by another tool) is no score, not zero.
            out.scores.extend((0..scores.len()).map(|i| if scores.is_null(i) { f32::NAN } else { scores.value(i) }));
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

/// The first caption line of a sample with its whitespace folded, hashed: what a score file's
/// `caption` column is compared on, so that a caption the input stores with other line breaks
/// or padding still matches the one scored.
pub fn caption_fingerprint(caption: &str) -> u64 {
    let first = caption.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("");
    xxhash_rust::xxh3::xxh3_64(first.split_whitespace().collect::<Vec<_>>().join(" ").as_bytes())
}

/// What the score files say of a sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Lookup {
    /// No file has the key.
    Missing,
    /// The key was scored with another caption: another dataset's sample under the same key.
    OtherCaption,
    /// The score: finite, or NaN / infinite for a sample whose score is unusable.
    Score(f32),
}

/// Who wrote a score file: the model (the directory it was loaded from, else the name the user
/// gave), the precision of its products and the embeddings' width, when kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scorer {
    pub model: String,
    pub precision: String,
}

impl Scorer {
    pub fn of(s: &ShardScores) -> Scorer {
        let model = s.meta("model").or(s.meta("checkpoint")).unwrap_or("an unnamed model").to_string();
        Scorer { model, precision: s.meta("precision").unwrap_or("f32").to_string() }
    }
}

impl std::fmt::Display for Scorer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} in {}", self.model, self.precision)
    }
}

/// The score files of a directory, sorted.
pub fn files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading the score directory {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "parquet"))
        .collect();
    files.sort();
    Ok(files)
}

/// Every sample's score (and image embedding, when asked and kept) from the score files of a
/// directory, by key. Keys must be unique across the files, as img2dataset makes them; every
/// file must come from one model at one precision, with embeddings of one width.
pub struct ScoreTable {
    pub by_key: HashMap<String, usize>,
    pub scores: Vec<f32>,
    /// Each row's [`caption_fingerprint`].
    pub captions: Vec<u64>,
    pub image_embeddings: Option<Vec<f32>>,
    pub dim: usize,
    pub dir: PathBuf,
    pub scorer: Scorer,
    /// Rows whose score is NaN, infinite or null: never kept by a score filter.
    pub unusable: u64,
}

impl ScoreTable {
    pub fn load(dir: &Path, embeddings: bool) -> Result<ScoreTable> {
        let files = files(dir)?;
        if files.is_empty() {
            bail!("{} holds no score files (align data score writes them)", dir.display());
        }
        let mut t = ScoreTable {
            by_key: HashMap::new(),
            scores: Vec::new(),
            captions: Vec::new(),
            image_embeddings: None,
            dim: 0,
            dir: dir.to_path_buf(),
            scorer: Scorer { model: String::new(), precision: String::new() },
            unusable: 0,
        };
        let mut first: Option<(PathBuf, Scorer)> = None;
        let mut width: Option<(PathBuf, usize)> = None;
        for f in files {
            let s = read(&f, embeddings)?;
            let scorer = Scorer::of(&s);
            match &first {
                None => first = Some((f.clone(), scorer.clone())),
                Some((path, want)) if *want != scorer => bail!(
                    "the score files of {} come from different models: {} from {want}, {} from {scorer}; score the whole input with one checkpoint into a directory of its own",
                    dir.display(),
                    path.display(),
                    f.display()
                ),
                Some(_) => {}
            }
            if embeddings && s.image_embeddings.is_none() && !s.keys.is_empty() {
                bail!("{} holds no image embeddings: score with --embeddings for deduplication", f.display());
            }
            if s.image_embeddings.is_some() {
                match &width {
                    None => width = Some((f.clone(), s.dim)),
                    Some((path, d)) if *d != s.dim => bail!(
                        "{} holds {}-dimensional embeddings and {} {d}-dimensional ones: the files come from different models",
                        f.display(),
                        s.dim,
                        path.display()
                    ),
                    Some(_) => {}
                }
            }
            for (key, caption) in s.keys.iter().zip(&s.captions) {
                let row = t.scores.len();
                if t.by_key.insert(key.clone(), row).is_some() {
                    bail!("sample key {key:?} appears twice in the score files of {} (keys must be unique across shards)", dir.display());
                }
                t.scores.push(0.0);
                t.captions.push(caption_fingerprint(caption));
            }
            let start = t.scores.len() - s.scores.len();
            t.scores[start..].copy_from_slice(&s.scores);
            t.unusable += s.scores.iter().filter(|x| !x.is_finite()).count() as u64;
            if let Some(e) = s.image_embeddings {
                t.dim = s.dim;
                t.image_embeddings.get_or_insert_with(Vec::new).extend(e);
            }
        }
        t.scorer = first.map(|(_, s)| s).expect("at least one file");
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

    /// The score of the sample `key` with `caption`, only if that is the pair that was scored.
    pub fn lookup(&self, key: &str, caption: &str) -> Lookup {
        match self.by_key.get(key) {
            None => Lookup::Missing,
            Some(&i) if self.captions[i] != caption_fingerprint(caption) => Lookup::OtherCaption,
            Some(&i) => Lookup::Score(self.scores[i]),
        }
    }

    /// The score above which the top `fraction` of the usable scores lie (NaN, infinite and
    /// null scores take no part: they are never kept).
    pub fn quantile_threshold(&self, fraction: f64) -> f32 {
        let mut s: Vec<f32> = self.scores.iter().copied().filter(|x| x.is_finite()).collect();
        s.sort_by(|a, b| b.total_cmp(a));
        let keep = ((fraction * s.len() as f64).ceil() as usize).clamp(1, s.len().max(1));
        s.get(keep - 1).copied().unwrap_or(f32::INFINITY)
    }
}

/// Whether a score filter keeps `score` at `threshold`: never a NaN or infinite score.
pub fn passes(score: f32, threshold: Option<f32>) -> bool {
    score.is_finite() && threshold.is_none_or(|t| score >= t)
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
        assert_eq!((t.lookup("b", "y"), t.dim, t.image_embeddings.as_ref().unwrap().len()), (Lookup::Score(-0.25), 2, 6));
        assert_eq!(
            (t.lookup("b", "  y \n"), t.lookup("b", "another"), t.lookup("q", "y")),
            (Lookup::Score(-0.25), Lookup::OtherCaption, Lookup::Missing)
        );
        // The top third of three scores is the best one; two thirds keep the two best.
        assert_eq!((t.quantile_threshold(1.0 / 3.0), t.quantile_threshold(0.5)), (0.5, 0.125));
    }

    fn shard(keys: &[&str], scores: Vec<f32>, model: &str, dim: usize) -> ShardScores {
        ShardScores {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            captions: keys.iter().map(|k| format!("caption of {k}")).collect(),
            image_embeddings: Some(vec![0.5; keys.len() * dim]),
            text_embeddings: None,
            scores,
            dim,
            meta: vec![("model".into(), model.into()), ("precision".into(), "f32".into())],
        }
    }

    #[test]
    fn files_of_two_models_or_two_widths_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        write(&dir.path().join("a.parquet"), &shard(&["a"], vec![0.1], "/m/one", 2)).unwrap();
        write(&dir.path().join("b.parquet"), &shard(&["b"], vec![0.2], "/m/two", 2)).unwrap();
        let e = format!("{:#}", ScoreTable::load(dir.path(), false).err().unwrap());
        assert!(e.contains("different models") && e.contains("a.parquet") && e.contains("/m/two"), "{e}");
        write(&dir.path().join("b.parquet"), &shard(&["b"], vec![0.2], "/m/one", 3)).unwrap();
        let e = format!("{:#}", ScoreTable::load(dir.path(), true).err().unwrap());
        assert!(e.contains("3-dimensional") && e.contains("a.parquet"), "{e}");
        let mut other = shard(&["b"], vec![0.2], "/m/one", 2);
        other.meta[1].1 = "bf16".into();
        write(&dir.path().join("b.parquet"), &other).unwrap();
        let e = format!("{:#}", ScoreTable::load(dir.path(), false).err().unwrap());
        assert!(e.contains("/m/one in bf16"), "{e}");
    }

    /// NaN, infinite and null scores are counted, take no part in the top fraction's cut and pass
    /// no threshold; a file of nothing but them leaves no cut anything passes.
    #[test]
    fn unusable_scores_are_counted_and_never_pass() {
        let dir = tempfile::tempdir().unwrap();
        write(&dir.path().join("a.parquet"), &shard(&["a", "b", "c", "d"], vec![f32::NAN, 0.3, f32::INFINITY, 0.1], "m", 2)).unwrap();
        let t = ScoreTable::load(dir.path(), false).unwrap();
        assert_eq!(t.unusable, 2);
        assert_eq!(t.quantile_threshold(0.5), 0.3);
        assert!(!passes(f32::NAN, None) && !passes(f32::INFINITY, Some(0.0)) && passes(0.3, Some(0.3)) && !passes(0.1, Some(0.3)));
        write(&dir.path().join("a.parquet"), &shard(&["a"], vec![f32::NAN], "m", 2)).unwrap();
        let t = ScoreTable::load(dir.path(), false).unwrap();
        assert!(!passes(t.scores[0], Some(t.quantile_threshold(0.3))));

        // A score column with nulls, as pandas writes a missing value.
        let schema = Arc::new(Schema::new(vec![
            Field::new("key", DataType::Utf8, false),
            Field::new("caption", DataType::Utf8, false),
            Field::new("score", DataType::Float32, true),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringArray::from(vec!["x", "y"])),
                Arc::new(StringArray::from(vec!["cx", "cy"])),
                Arc::new(Float32Array::from(vec![None, Some(0.5)])),
            ],
        )
        .unwrap();
        let path = dir.path().join("a.parquet");
        let mut w = ArrowWriter::try_new(File::create(&path).unwrap(), schema, None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let s = read(&path, false).unwrap();
        assert!(s.scores[0].is_nan() && s.scores[1] == 0.5, "{:?}", s.scores);
    }
}
