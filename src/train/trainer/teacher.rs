//! A run's distillation teacher: the checkpoint `distill.teacher` names (loaded forward-only and
//! frozen, fed its own view of every sample), or the stored embeddings `distill.embeddings`
//! names (checked whole before the first step). Either has an identity that a checkpoint
//! records, so that a resume under another teacher is refused.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};

use crate::config::{Config, LossKind, Precision};
use crate::data::curate::scores::{self, Scorer};
use crate::data::teacher_feed::TeacherFeed;
use crate::io::load::{load_model, LoadedModel};
use crate::train::distill_loss::TeacherLogits;
use crate::train::step::Distill;
use crate::util::log;

pub(crate) struct Teacher {
    /// The online teacher; None for stored embeddings.
    pub model: Option<LoadedModel>,
    pub logits: TeacherLogits,
    pub feed: Arc<TeacherFeed>,
    /// What the checkpoint records of the teacher: its weights' hash, or its score files' model.
    pub identity: String,
}

impl Teacher {
    /// The run's teacher, if it distils.
    pub fn of(cfg: &Config, device: &Device, quiet: bool) -> Result<Option<Teacher>> {
        let d = &cfg.distill;
        let teacher = if !d.teacher.as_os_str().is_empty() {
            if d.precision == Precision::Bf16 && !(device.is_cpu() && crate::ops::kernels::bf16_gemm::available()) {
                bail!("distill.precision = \"bf16\" runs the teacher's products on the CPU's AVX-512 BF16 instructions, which this device lacks: leave it \"f32\"");
            }
            online(&d.teacher, device)?
        } else if !d.embeddings.as_os_str().is_empty() {
            stored(&d.embeddings)?
        } else {
            return Ok(None);
        };
        if cfg.loss.kind == LossKind::Sigmoid && teacher.logits.bias.is_none() {
            bail!(
                "loss.kind = \"sigmoid\" distils from a teacher with a logit bias (a SigLIP teacher): {} has none; use a softmax student or a sigmoid teacher",
                teacher.identity
            );
        }
        if !quiet {
            let bias = teacher.logits.bias.map_or(String::new(), |b| format!(", bias {b:.3}"));
            log::info(format!(
                "distilling from {} (logit scale {:.3}{bias}) with the {:?} loss at weight {}{}",
                teacher.identity,
                teacher.logits.scale,
                d.loss,
                d.weight,
                if d.contrastive { " beside the contrastive loss" } else { ", without the contrastive loss" }
            ));
        }
        Ok(Some(teacher))
    }

    pub fn step<'a>(&'a self, cfg: &Config) -> Distill<'a> {
        Distill {
            teacher: self.model.as_ref().map(|m| &m.model),
            logits: self.logits,
            weight: cfg.distill.weight,
            contrastive: cfg.distill.contrastive,
            kind: cfg.distill.loss,
            bf16: cfg.distill.precision == Precision::Bf16,
        }
    }
}

fn online(path: &Path, device: &Device) -> Result<Teacher> {
    let m = load_model(path, device).with_context(|| format!("loading the teacher distill.teacher = {}", path.display()))?;
    let scalar = |t: candle_core::Tensor| -> Result<f64> { Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?) };
    let logits = TeacherLogits { scale: scalar(m.model.logit_scale()?)?, bias: m.model.logit_bias()?.map(scalar).transpose()? };
    // The weights themselves, hashed in name order: the same teacher in any format or place
    // has one identity, a retrained one at the same path another.
    let mut names: Vec<&String> = m.weights.keys().collect();
    names.sort();
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    for name in names {
        hasher.update(name.as_bytes());
        let values = m.weights[name].flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        hasher.update(&bytes);
    }
    let identity = format!("the teacher {} (weights xxh3 {:016x})", m.dir.display(), hasher.digest());
    let feed = Arc::new(TeacherFeed::Online { image: m.usage.image.clone(), tokenizer: Arc::new(m.tokenizer.clone()) });
    Ok(Teacher { model: Some(m), logits, feed, identity })
}

/// Stored embeddings: every score file of one model, with embeddings and the teacher's logit
/// scale, or an error naming the file that is not.
fn stored(dir: &Path) -> Result<Teacher> {
    let files = scores::files(dir).with_context(|| format!("distill.embeddings = {}", dir.display()))?;
    if files.is_empty() {
        bail!("distill.embeddings = {}: no score files (.parquet) there; write them with align data score --embeddings", dir.display());
    }
    let mut first: Option<(Scorer, f64, Option<f64>, &Path)> = None;
    for file in &files {
        let meta = scores::read_meta(file)?;
        if meta.meta("embeddings") != Some("true") {
            bail!("{}: scored without --embeddings; distillation needs the teacher's embeddings", file.display());
        }
        let number =
            |key: &str| meta.meta(key).map(|v| v.parse::<f64>().with_context(|| format!("{}: {key} {v:?}", file.display()))).transpose();
        let Some(scale) = number("logit_scale")? else {
            bail!("{}: no logit_scale recorded (written by an older align data score): score the shards again", file.display());
        };
        let bias = number("logit_bias")?;
        let scorer = Scorer::of(&meta);
        match &first {
            None => first = Some((scorer, scale, bias, file)),
            Some((s, ..)) if *s != scorer => bail!(
                "{} holds embeddings of {s} ({}) and of {scorer} ({}): distillation reads one teacher's",
                dir.display(),
                first.as_ref().map_or(String::new(), |f| f.3.display().to_string()),
                file.display()
            ),
            Some(_) => {}
        }
    }
    let (scorer, scale, bias, _) = first.expect("at least one file");
    let identity = format!("the embeddings of {scorer} in {} ({} files)", dir.display(), files.len());
    Ok(Teacher {
        model: None,
        logits: TeacherLogits { scale, bias },
        feed: Arc::new(TeacherFeed::Stored { dir: dir.to_path_buf() }),
        identity,
    })
}
