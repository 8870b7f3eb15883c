//! Zero-shot classification with prompt ensembles (CLIP's recipe, which ALIGN follows): each class
//! is the renormalised mean of the normalised embeddings of every template filled with its name.

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::Device;

use super::embed::{embed_texts, Embedder};
use super::metrics::{classify, ensemble, ClassificationReport, Embeddings};
use crate::data::eval_reader::{EvalSource, Needs};
use crate::data::skips::SkipCounts;
use crate::data::tokenizer::TextTokenizer;
use crate::model::dual_encoder::DualEncoder;
use crate::util::progress::Progress;

/// Non-empty lines of a text file (class names, templates).
pub fn read_lines(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let lines: Vec<String> = text.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect();
    if lines.is_empty() {
        bail!("{} is empty", path.display());
    }
    Ok(lines)
}

/// Fills a template: `{}` (CLIP / open_clip style) or `{c}` is replaced by the class name.
pub fn fill(template: &str, class: &str) -> String {
    if template.contains("{}") {
        template.replace("{}", class)
    } else if template.contains("{c}") {
        template.replace("{c}", class)
    } else {
        format!("{template} {class}")
    }
}

/// Class embeddings: `classes × embed_dim`, each the ensemble over `templates`.
pub fn class_embeddings(
    model: &DualEncoder,
    tokenizer: &TextTokenizer,
    classes: &[String],
    templates: &[String],
    batch: usize,
    device: &Device,
    quiet: bool,
) -> Result<Embeddings> {
    let prompts: Vec<String> = classes.iter().flat_map(|c| templates.iter().map(move |t| fill(t, c))).collect();
    let bar = Progress::bar(prompts.len() as u64, "embedding prompts", quiet);
    let per = embed_texts(model, tokenizer, &prompts, batch, device, |n| bar.inc(n as u64))?;
    bar.finish();
    Ok(ensemble(&per, templates.len()))
}

pub struct ZeroShotRun {
    pub report: ClassificationReport,
    pub skipped: SkipCounts,
}

/// Labels of embedded images, checked against the class count.
pub fn checked_labels(keys: &[String], labels: &[Option<i64>], classes: usize) -> Result<Vec<usize>> {
    keys.iter()
        .zip(labels)
        .map(|(k, l)| match l {
            Some(l) if *l >= 0 && (*l as usize) < classes => Ok(*l as usize),
            Some(l) => bail!("sample {k} has label {l} but there are {classes} classes"),
            None => bail!("sample {k} has no label"),
        })
        .collect()
}

pub fn run(e: &Embedder, source: EvalSource, classes: &[String], templates: &[String]) -> Result<ZeroShotRun> {
    let class_emb = class_embeddings(e.model, e.tokenizer, classes, templates, e.batch, e.device, e.quiet)?;
    let images = e.images(source, Needs { image: true, captions: false, label: true })?;
    let labels = checked_labels(&images.keys, &images.labels, classes.len())?;
    let report = classify(&images.embeddings, &labels, &class_emb, 1024)?;
    Ok(ZeroShotRun { report, skipped: images.skipped })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_are_filled_in_either_style() {
        assert_eq!(fill("a photo of a {}.", "dog"), "a photo of a dog.");
        assert_eq!(fill("itap of a {c}", "cat"), "itap of a cat");
        assert_eq!(fill("photo", "cat"), "photo cat");
    }
}
