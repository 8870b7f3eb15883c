//! `align inspect PATH`: what align understood of a checkpoint in any format it reads: the
//! format, the towers and their sizes, parameter counts, the tokenizer, the preprocessing, and
//! the logit scale and bias.

use std::path::PathBuf;

use align::io::load::load_model;
use align::model::dual_encoder::{ImageSpec, TextSpec};
use anyhow::Result;
use candle_core::Device;
use clap::Args;
use serde::Serialize;

use super::table::Table;

#[derive(Args)]
pub struct InspectArgs {
    /// A checkpoint: an align checkpoint or run directory, a Hugging Face or open_clip folder, or
    /// `hf:ORG/NAME[@REVISION]`.
    pub path: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Report {
    path: String,
    format: &'static str,
    dir: String,
    step: Option<u64>,
    image_tower: String,
    text_tower: String,
    embed_dim: usize,
    parameters: Parameters,
    tokenizer: TokenizerReport,
    /// The checkpoint's preprocessing, with the training augmentation a fine-tune from it uses
    /// (`train_crop`, `rrc_*`, `hflip`).
    preprocessing: align::data::transform::ImageConfig,
    loss: align::config::LossKind,
    logit_scale: f64,
    logit_bias: Option<f64>,
    /// How a training checkpoint holds its optimizer state (none for other formats).
    optimizer_state: Option<String>,
    spec: align::model::dual_encoder::ModelSpec,
}

/// One file, or a file per rank of a sharded run (`train.shard`) with their manifest.
fn optimizer_state(dir: &std::path::Path) -> Option<String> {
    use align::io::{run_dir, state_shards};
    if dir.join(state_shards::MANIFEST_FILE).is_file() {
        return Some(match state_shards::read_manifest(dir) {
            Ok(m) => format!(
                "sharded over {} ranks (train.shard = \"{}\"): {} tensors in {} files",
                m.world_size,
                m.mode,
                m.shards.iter().map(|s| s.tensors.len()).sum::<usize>(),
                m.shards.len()
            ),
            Err(e) => format!("sharded, but its manifest is unreadable: {e:#}"),
        });
    }
    dir.join(run_dir::OPTIMIZER_FILE).is_file().then(|| format!("whole ({})", run_dir::OPTIMIZER_FILE))
}

#[derive(Serialize)]
struct Parameters {
    image: usize,
    text: usize,
    other: usize,
    total: usize,
}

#[derive(Serialize)]
struct TokenizerReport {
    vocabulary: usize,
    max_len: usize,
    pad_token: String,
}

fn describe_image(i: &ImageSpec) -> String {
    match i {
        ImageSpec::EfficientNet(e) => format!(
            "EfficientNet ({}) at {} px",
            align::model::efficientnet::EfficientNetConfig::preset_name(e).unwrap_or("custom"),
            e.image_size
        ),
        ImageSpec::Vit(v) => format!("ViT {}px/{}, width {}, {} layers, {} heads", v.image_size, v.patch_size, v.width, v.depth, v.heads),
        ImageSpec::Clip(v) => format!(
            "CLIP ViT {}px/{}, width {}, {} layers, {} heads, {}",
            v.image_size,
            v.patch_size,
            v.encoder.width,
            v.encoder.layers,
            v.encoder.heads,
            v.encoder.act.hf_name()
        ),
        ImageSpec::Siglip(v) => format!(
            "SigLIP ViT {}px/{}, width {}, {} layers, {} heads",
            v.image_size, v.patch_size, v.encoder.width, v.encoder.layers, v.encoder.heads
        ),
        ImageSpec::Naflex(v) => format!(
            "SigLIP 2 NaFlex ViT, patch {}, up to {} patches, {}×{} position grid, width {}, {} layers, {} heads",
            v.patch_size, v.max_patches, v.position_grid, v.position_grid, v.encoder.width, v.encoder.layers, v.encoder.heads
        ),
    }
}

fn describe_text(t: &TextSpec) -> String {
    match t {
        TextSpec::Bert(b) => format!("BERT width {}, {} layers, {} positions", b.hidden, b.layers, b.max_position),
        TextSpec::Clip(c) => format!(
            "CLIP text width {}, {} layers, {} positions, {}",
            c.encoder.width,
            c.encoder.layers,
            c.max_position,
            c.encoder.act.hf_name()
        ),
        TextSpec::Siglip(c) => format!("SigLIP text width {}, {} layers, {} positions", c.encoder.width, c.encoder.layers, c.max_position),
    }
}

pub fn run(a: &InspectArgs) -> Result<()> {
    let m = load_model(&a.path, &Device::Cpu)?;
    let count = |prefix: &str| m.weights.iter().filter(|(k, _)| k.starts_with(prefix)).map(|(_, t)| t.elem_count()).sum::<usize>();
    let total: usize = m.weights.values().map(|t| t.elem_count()).sum();
    let (image, text) = (count("vision_model.") + count("visual_projection."), count("text_model.") + count("text_projection."));
    let spec = m.spec().clone();
    let report = Report {
        path: a.path.display().to_string(),
        format: m.format.name(),
        dir: m.dir.display().to_string(),
        step: m.step,
        image_tower: describe_image(&spec.image),
        text_tower: describe_text(&spec.text),
        embed_dim: spec.embed_dim,
        parameters: Parameters { image, text, other: total - image - text, total },
        tokenizer: TokenizerReport {
            vocabulary: m.tokenizer.vocab_size(),
            max_len: m.tokenizer.max_len(),
            pad_token: m.tokenizer.inner().id_to_token(m.tokenizer.pad_id()).unwrap_or_default(),
        },
        preprocessing: align::train::start::train_image(&m.usage.image, &spec),
        loss: m.usage.loss,
        logit_scale: m.model.logit_scale()?.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?,
        logit_bias: m.model.logit_bias()?.map(|b| b.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()).transpose()?,
        optimizer_state: optimizer_state(&m.dir),
        spec,
    };
    if a.json {
        return super::print_json(&report);
    }
    let p = &report.preprocessing;
    let mut t = Table::new(&format!("{} ({} format)", report.path, report.format));
    t.row("directory", report.dir.clone());
    if let Some(step) = report.step {
        t.row("step", step.to_string());
    }
    if let Some(o) = &report.optimizer_state {
        t.row("optimizer state", o.clone());
    }
    t.row("image tower", report.image_tower.clone());
    t.row("text tower", report.text_tower.clone());
    t.row("embedding", format!("{} wide", report.embed_dim));
    let millions = |n: usize| format!("{:.2}M", n as f64 / 1e6);
    t.row(
        "parameters",
        format!(
            "{} (image {}, text {}, other {})",
            millions(report.parameters.total),
            millions(image),
            millions(text),
            millions(report.parameters.other)
        ),
    );
    t.row(
        "tokenizer",
        format!(
            "{} tokens, {} per text, padded with {:?}",
            report.tokenizer.vocabulary, report.tokenizer.max_len, report.tokenizer.pad_token
        ),
    );
    use align::config::as_written as w;
    t.row("image size", format!("{} px (resize {} {}, {})", p.image_size, p.resize, w(&p.resize_mode), w(&p.interpolation)));
    t.row("mean / std", format!("{} / {}", w(&p.mean), w(&p.std)));
    t.row("fine-tune augmentation", format!("{}, flip {}", w(&p.train_crop), p.hflip));
    t.row("loss", w(&report.loss));
    t.row("logit scale", format!("{:.4}", report.logit_scale));
    if let Some(b) = report.logit_bias {
        t.row("logit bias", format!("{b:.4}"));
    }
    t.print();
    Ok(())
}
