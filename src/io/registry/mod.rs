//! Every checkpoint format align knows, in one list, and the doors through which the rest of
//! align meets them: [`locate`] resolves a location (a folder, `hf:ORG/NAME[@REVISION]`, an align
//! run directory) once into a local directory and the one format it holds; [`writer`] chooses the
//! format `export --format` names; [`export::export`] writes one atomically. `--checkpoint` (eval,
//! embed, search, score), `model.init`, `export` and `inspect` all go through here.
//!
//! Adding a format is one module under `io::format` implementing its trait and one line in
//! [`FORMATS`] (in `formats`).

pub mod export;
mod formats;
mod resolve;

use anyhow::{bail, Result};

pub use formats::{named, read_list, FORMATS};
pub use resolve::{locate, locate_tower, Located};

use crate::io::format::Format;
use crate::model::dual_encoder::{ImageSpec, ModelSpec, TextSpec};

/// The format `export --format NAME` writes a model of these sizes in: `hf` is the first Hugging
/// Face class that holds its towers; any other name is a format align writes.
pub fn writer(name: &str, spec: &ModelSpec) -> Result<&'static dyn Format> {
    if name == "hf" {
        let mut why = Vec::new();
        for f in FORMATS.iter().copied().filter(|f| f.hugging_face() && f.writes()) {
            match f.can_write(spec) {
                Ok(()) => return Ok(f),
                Err(e) => why.push(format!("{}: {e}", f.name())),
            }
        }
        bail!(
            "no Hugging Face layout fits a {} image tower with a {} text tower ({})",
            image_kind(&spec.image),
            text_kind(&spec.text),
            why.join("; ")
        );
    }
    match named(name).filter(|f| f.writes()) {
        Some(f) => Ok(f),
        None => {
            let written: Vec<&str> = std::iter::once("hf").chain(FORMATS.iter().filter(|f| f.writes()).map(|f| f.name())).collect();
            bail!("--format {name:?} is not a format align writes ({})", written.join(", "))
        }
    }
}

fn image_kind(i: &ImageSpec) -> &'static str {
    match i {
        ImageSpec::Vit(_) => "ViT",
        ImageSpec::EfficientNet(_) => "EfficientNet",
        ImageSpec::Clip(_) => "CLIP",
        ImageSpec::Siglip(_) => "SigLIP",
        ImageSpec::Naflex(_) => "SigLIP 2 NaFlex",
    }
}

fn text_kind(t: &TextSpec) -> &'static str {
    match t {
        TextSpec::Bert(_) => "BERT",
        TextSpec::Clip(_) => "CLIP",
        TextSpec::Siglip(_) => "SigLIP",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `hf` tries every Hugging Face class in order and says why each refused; other names are
    /// the formats written, and the refusal lists them.
    #[test]
    fn export_chooses_among_the_formats_it_writes() {
        let vit_bert = crate::model::dual_encoder::tests::tiny_spec();
        let e = writer("hf", &vit_bert).err().expect("the tiny ViT + BERT fits no class").to_string();
        for class in ["AlignModel:", "CLIPModel:", "SiglipModel:", "VisionTextDualEncoderModel:"] {
            assert!(e.contains(class), "{e}");
        }
        assert_eq!(writer("clipmodel", &vit_bert).unwrap().name(), "CLIPModel");
        let e = writer("align", &vit_bert).err().expect("align's own format is not exported").to_string();
        assert!(e.contains("hf, AlignModel, CLIPModel, SiglipModel, Siglip2Model, VisionTextDualEncoderModel, open_clip"), "{e}");
    }
}
