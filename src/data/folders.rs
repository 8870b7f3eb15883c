//! Evaluation sets that live as image folders rather than shards: ImageNet's validation layout
//! (`val/<wnid>/*.JPEG`), ImageNet-V2 (`<label>/*.jpeg`, folders 0..999), ImageNet-R / -A (wnid
//! folders for 200 classes), and the Karpathy splits of Flickr30K and MSCOCO.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use super::eval_reader::FileSample;

/// The 1000 ImageNet classes in label order, with their WordNet ids, the 80 CLIP prompt
/// templates, and the ImageNet-R / -A subsets (see `scripts/export_zeroshot_metadata.py`).
pub mod imagenet {
    pub const CLASSES: &str = include_str!("../../configs/zeroshot/imagenet_classes.txt");
    pub const WNIDS: &str = include_str!("../../configs/zeroshot/imagenet_wnids.txt");
    pub const TEMPLATES: &str = include_str!("../../configs/zeroshot/imagenet_templates.txt");
    pub const R_INDICES: &str = include_str!("../../configs/zeroshot/imagenet_r_indices.txt");
    pub const A_INDICES: &str = include_str!("../../configs/zeroshot/imagenet_a_indices.txt");

    pub fn lines(s: &str) -> Vec<String> {
        s.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect()
    }
}

fn is_image(p: &Path) -> bool {
    p.extension().map(|e| e.to_string_lossy().to_lowercase()).is_some_and(|e| matches!(e.as_str(), "jpeg" | "jpg" | "png" | "webp"))
}

fn images_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_file() && is_image(p))
        .collect();
    files.sort();
    Ok(files)
}

/// Which ImageNet-style layout a folder has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Variant {
    /// ImageNet-1k validation: `<wnid>/*.JPEG`, 1000 classes.
    Val,
    /// ImageNet-V2: folders `0` … `999` named by label.
    V2,
    /// ImageNet-R: `<wnid>/*.jpg` for 200 classes.
    R,
    /// ImageNet-A: `<wnid>/*.jpg` for 200 classes.
    A,
}

/// Class names and samples of an ImageNet-style folder. `dir` may be the split folder itself or
/// its parent holding `val/`. Labels index the returned class names.
pub fn imagenet_folder(dir: &Path, variant: Variant, classes: &[String], wnids: &[String]) -> Result<(Vec<String>, Vec<FileSample>)> {
    if classes.len() != wnids.len() {
        bail!("{} class names but {} WordNet ids", classes.len(), wnids.len());
    }
    let dir = if variant == Variant::Val && dir.join("val").is_dir() { dir.join("val") } else { dir.to_path_buf() };
    let subset: Vec<usize> = match variant {
        Variant::Val | Variant::V2 => (0..classes.len()).collect(),
        Variant::R => imagenet::lines(imagenet::R_INDICES).iter().map(|s| s.parse().unwrap()).collect(),
        Variant::A => imagenet::lines(imagenet::A_INDICES).iter().map(|s| s.parse().unwrap()).collect(),
    };
    if subset.iter().any(|&i| i >= classes.len()) {
        bail!("the {variant:?} subset indexes beyond the {} classes given", classes.len());
    }
    let mut samples = Vec::new();
    let mut missing = Vec::new();
    for (label, &c) in subset.iter().enumerate() {
        let folder = match variant {
            Variant::V2 => dir.join(c.to_string()),
            _ => dir.join(&wnids[c]),
        };
        if !folder.is_dir() {
            missing.push(folder.file_name().unwrap_or_default().to_string_lossy().to_string());
            continue;
        }
        for path in images_in(&folder)? {
            samples.push(FileSample { path, label: Some(label as i64), captions: Vec::new() });
        }
    }
    if samples.is_empty() {
        bail!("no images found under {} in the {variant:?} layout (e.g. missing folder {:?})", dir.display(), missing.first());
    }
    if !missing.is_empty() {
        crate::util::log::warn(format!(
            "{} of {} class folders missing under {} (first: {})",
            missing.len(),
            subset.len(),
            dir.display(),
            missing[0]
        ));
    }
    Ok((subset.iter().map(|&c| classes[c].clone()).collect(), samples))
}

#[derive(Deserialize)]
struct KarpathyFile {
    images: Vec<KarpathyImage>,
}

#[derive(Deserialize)]
struct KarpathyImage {
    filename: String,
    #[serde(default)]
    filepath: Option<String>,
    split: String,
    sentences: Vec<KarpathySentence>,
}

#[derive(Deserialize)]
struct KarpathySentence {
    raw: String,
}

/// The images of one split (`test`, `val`, `train`, `restval`) of a Karpathy split file
/// (`dataset_flickr30k.json`, `dataset_coco.json`), each with its raw captions. COCO entries
/// carry a `filepath` (`val2014`) under the image root.
pub fn karpathy(json: &Path, images: &Path, split: &str) -> Result<Vec<FileSample>> {
    let text = std::fs::read_to_string(json).with_context(|| format!("reading {}", json.display()))?;
    let file: KarpathyFile = serde_json::from_str(&text).with_context(|| format!("{} is not a Karpathy split file", json.display()))?;
    let out: Vec<FileSample> = file
        .images
        .into_iter()
        .filter(|im| im.split == split)
        .map(|im| {
            let path = match &im.filepath {
                Some(fp) if !fp.is_empty() => images.join(fp).join(&im.filename),
                _ => images.join(&im.filename),
            };
            FileSample { path, label: None, captions: im.sentences.into_iter().map(|s| s.raw.trim().to_string()).collect() }
        })
        .collect();
    if out.is_empty() {
        bail!("{} has no image in split {split:?}", json.display());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch_png(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        image::RgbImage::from_pixel(4, 4, image::Rgb([1, 2, 3])).save(path).unwrap();
    }

    #[test]
    fn imagenet_val_layout_labels_by_wnid_order() {
        let dir = tempfile::tempdir().unwrap();
        let classes: Vec<String> = vec!["tench".into(), "goldfish".into(), "shark".into()];
        let wnids: Vec<String> = vec!["n01".into(), "n02".into(), "n03".into()];
        touch_png(&dir.path().join("val/n03/b.png"));
        touch_png(&dir.path().join("val/n03/a.png"));
        touch_png(&dir.path().join("val/n01/x.png"));
        std::fs::write(dir.path().join("val/n01/readme.txt"), "not an image").unwrap();
        let (names, samples) = imagenet_folder(dir.path(), Variant::Val, &classes, &wnids).unwrap();
        assert_eq!(names, classes);
        let got: Vec<(String, i64)> =
            samples.iter().map(|s| (s.path.file_name().unwrap().to_string_lossy().to_string(), s.label.unwrap())).collect();
        assert_eq!(got, vec![("x.png".into(), 0), ("a.png".into(), 2), ("b.png".into(), 2)]);
    }

    #[test]
    fn imagenet_v2_folders_are_labels() {
        let dir = tempfile::tempdir().unwrap();
        let classes: Vec<String> = (0..3).map(|i| format!("c{i}")).collect();
        let wnids: Vec<String> = (0..3).map(|i| format!("n{i}")).collect();
        touch_png(&dir.path().join("1/img.png"));
        let (_, samples) = imagenet_folder(dir.path(), Variant::V2, &classes, &wnids).unwrap();
        assert_eq!(samples.len(), 1);
        assert_eq!(samples[0].label, Some(1));
    }

    #[test]
    fn imagenet_r_uses_its_200_class_subset() {
        let classes = imagenet::lines(imagenet::CLASSES);
        let wnids = imagenet::lines(imagenet::WNIDS);
        let r: Vec<usize> = imagenet::lines(imagenet::R_INDICES).iter().map(|s| s.parse().unwrap()).collect();
        let dir = tempfile::tempdir().unwrap();
        touch_png(&dir.path().join(&wnids[r[5]]).join("i.png"));
        let (names, samples) = imagenet_folder(dir.path(), Variant::R, &classes, &wnids).unwrap();
        assert_eq!(names.len(), 200);
        assert_eq!(samples[0].label, Some(5));
        assert_eq!(names[5], classes[r[5]]);
    }

    #[test]
    fn shipped_imagenet_metadata_is_complete() {
        assert_eq!(imagenet::lines(imagenet::CLASSES).len(), 1000);
        assert_eq!(imagenet::lines(imagenet::WNIDS).len(), 1000);
        assert_eq!(imagenet::lines(imagenet::TEMPLATES).len(), 80);
        assert!(imagenet::lines(imagenet::TEMPLATES).iter().all(|t| t.contains("{}")));
    }

    #[test]
    fn karpathy_split_selects_images_with_their_captions() {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("dataset_coco.json");
        std::fs::write(
            &json,
            r#"{"images": [
                {"filename": "a.jpg", "filepath": "val2014", "split": "test", "sentences": [{"raw": "A dog. "}, {"raw": "a puppy"}]},
                {"filename": "b.jpg", "filepath": "train2014", "split": "train", "sentences": [{"raw": "x"}]},
                {"filename": "c.jpg", "split": "test", "sentences": [{"raw": "cat"}]}
            ], "dataset": "coco"}"#,
        )
        .unwrap();
        let got = karpathy(&json, Path::new("/imgs"), "test").unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].path, Path::new("/imgs/val2014/a.jpg"));
        assert_eq!(got[0].captions, vec!["A dog.", "a puppy"]);
        assert_eq!(got[1].path, Path::new("/imgs/c.jpg"));
        assert!(karpathy(&json, Path::new("/imgs"), "val").is_err());
    }
}
