//! Image decoding and the train / eval transforms, writing normalised CHW floats in place.
//!
//! ALIGN (and Hugging Face's `AlignProcessor`) resizes to a square ignoring aspect ratio (346) and
//! crops 289: randomly with a horizontal flip for training, centrally for evaluation. CLIP-style
//! training uses a random resized crop instead, and evaluation resizes the shorter side. Both are
//! configured by [`ImageConfig`]; the pixels are written straight into the batch buffer.

use std::io::Cursor;

use image::RgbImage;
use serde::{Deserialize, Serialize};

use super::skips::reason;
use crate::util::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ResizeMode {
    /// Resize to `resize`×`resize` ignoring the aspect ratio (ALIGN / EfficientNet preprocessing).
    Square,
    /// Resize so the shorter side is `resize`, keeping the aspect ratio (CLIP, torchvision).
    Shorter,
    /// Resize so the longer side is `resize`, keeping the aspect ratio, then pad to a square
    /// with black (open_clip's `resize_mode = "longest"`).
    Longer,
}

/// Where a centre crop starts when the margin is odd.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CropOffset {
    /// `(size − crop) // 2`, as transformers' processors place it.
    #[default]
    Floor,
    /// `round((size − crop) / 2)` with ties to even, as torchvision's `CenterCrop` (open_clip)
    /// places it.
    Round,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TrainCrop {
    /// Resize per `resize_mode`, then a uniformly placed `image_size` crop (ALIGN).
    RandomCrop,
    /// torchvision's RandomResizedCrop with `rrc_scale` / `rrc_ratio` (CLIP / open_clip).
    RandomResizedCrop,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Interpolation {
    /// The nearest pixel.
    Nearest,
    /// Antialiased when shrinking, like PIL's BILINEAR.
    Bilinear,
    /// Catmull-Rom cubic, antialiased when shrinking, like PIL's BICUBIC (CLIP).
    Bicubic,
    /// Lanczos with three lobes, like PIL's LANCZOS.
    Lanczos,
}

impl Interpolation {
    fn algorithm(self) -> fast_image_resize::ResizeAlg {
        use fast_image_resize::{FilterType, ResizeAlg};
        match self {
            Interpolation::Nearest => ResizeAlg::Nearest,
            // Convolution filters widen their support when shrinking: antialiased as PIL's.
            Interpolation::Bilinear => ResizeAlg::Convolution(FilterType::Bilinear),
            Interpolation::Bicubic => ResizeAlg::Convolution(FilterType::CatmullRom),
            Interpolation::Lanczos => ResizeAlg::Convolution(FilterType::Lanczos3),
        }
    }
}

/// How images become tensors. Defaults are ALIGN's (paper §5 and `AlignProcessor`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ImageConfig {
    /// Side of the square the towers see, in pixels.
    pub image_size: usize,
    /// Resize target before cropping, in pixels (the square's side, or the shorter or longer
    /// side per `resize_mode`).
    pub resize: usize,
    /// `square` (ALIGN), `shorter` (CLIP, torchvision) or `longer` (open_clip's `longest`, padded).
    pub resize_mode: ResizeMode,
    /// `random_crop` (ALIGN) or `random_resized_crop` (CLIP, open_clip).
    pub train_crop: TrainCrop,
    /// RandomResizedCrop area fraction range.
    pub rrc_scale: [f64; 2],
    /// RandomResizedCrop aspect-ratio range.
    pub rrc_ratio: [f64; 2],
    /// Random horizontal flip with probability 0.5 during training.
    pub hflip: bool,
    /// Per-channel (R, G, B) mean subtracted from pixels scaled to [0, 1].
    pub mean: [f32; 3],
    /// Per-channel (R, G, B) divisor applied after the mean.
    pub std: [f32; 3],
    /// The resampling filter of every resize.
    pub interpolation: Interpolation,
    /// Where the evaluation's centre crop starts when the margin is odd.
    pub crop_offset: CropOffset,
    /// Images whose header claims more pixels than this are skipped unread (decompression bombs).
    pub max_pixels: u64,
    /// How a transparent image becomes RGB: `drop` its alpha channel (PIL's `convert("RGB")`,
    /// as open_clip and transformers' pipelines read images) or composite it over `white` (what
    /// transformers' CLIP and SigLIP processors do with a transparent PIL image handed to them
    /// as it is).
    pub alpha: Alpha,
    /// SigLIP 2's NaFlex input instead of a square: the image resized, keeping its aspect
    /// ratio, to at most `max_num_patches` patches of `patch_size` pixels (transformers'
    /// `Siglip2ImageProcessor`). Absent for every other tower.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub naflex: Option<Naflex>,
}

/// A NaFlex patch budget (see [`ImageConfig::naflex`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Naflex {
    /// Side of a square patch, in pixels (the tower's).
    pub patch_size: usize,
    /// The most patches an image becomes.
    pub max_num_patches: usize,
}

impl Naflex {
    /// The image's size in pixels (height, width) at this budget, as transformers chooses it:
    /// the largest scale (found by bisection to 1e-5) whose sides, each rounded up to whole
    /// patches, give at most `max_num_patches` patches.
    pub fn size_for(&self, height: u32, width: u32) -> (u32, u32) {
        let p = self.patch_size as f64;
        let side = |scale: f64, size: u32| -> f64 { ((size as f64 * scale / p).ceil() * p).max(p) };
        let (mut lo, mut hi) = (1e-5 / 10.0, 100.0);
        while hi - lo >= 1e-5 {
            let scale = (lo + hi) / 2.0;
            let patches = (side(scale, height) / p) * (side(scale, width) / p);
            if patches <= self.max_num_patches as f64 {
                lo = scale;
            } else {
                hi = scale;
            }
        }
        (side(lo, height) as u32, side(lo, width) as u32)
    }

    /// Numbers per image: the patches, then the grid's height and width.
    pub fn numel(&self) -> usize {
        self.max_num_patches * 3 * self.patch_size * self.patch_size + 2
    }
}

/// How transparency is flattened (see [`ImageConfig::alpha`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Alpha {
    #[default]
    Drop,
    White,
}

impl Default for ImageConfig {
    fn default() -> Self {
        Self {
            image_size: 289,
            resize: 346,
            resize_mode: ResizeMode::Square,
            train_crop: TrainCrop::RandomCrop,
            rrc_scale: [0.9, 1.0],
            rrc_ratio: [3.0 / 4.0, 4.0 / 3.0],
            hflip: true,
            // x / 127.5 - 1, as AlignProcessor scales.
            mean: [0.5, 0.5, 0.5],
            std: [0.5, 0.5, 0.5],
            interpolation: Interpolation::Bilinear,
            crop_offset: CropOffset::Floor,
            // PIL's default MAX_IMAGE_PIXELS.
            max_pixels: 89_478_485,
            alpha: Alpha::Drop,
            naflex: None,
        }
    }
}

impl ImageConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.image_size == 0 {
            return Err("image_size must be positive".into());
        }
        if self.resize < self.image_size && self.resize_mode != ResizeMode::Longer {
            return Err(format!("resize ({}) must be at least image_size ({})", self.resize, self.image_size));
        }
        if self.resize_mode == ResizeMode::Longer && self.resize != self.image_size {
            return Err(format!(
                "resize_mode \"longer\" pads to the resized square: resize ({}) must equal image_size ({})",
                self.resize, self.image_size
            ));
        }
        if self.resize_mode == ResizeMode::Longer && self.train_crop == TrainCrop::RandomCrop {
            return Err("resize_mode \"longer\" trains with train_crop = \"random_resized_crop\"".into());
        }
        let bound = MAX_SIDE;
        if self.image_size > bound || self.resize > bound {
            return Err(format!("image_size {} and resize {} must be at most {bound} px", self.image_size, self.resize));
        }
        if !(0.0 < self.rrc_scale[0] && self.rrc_scale[0] <= self.rrc_scale[1] && self.rrc_scale[1] <= 1.0) {
            return Err(format!("rrc_scale {:?} must satisfy 0 < lo <= hi <= 1", self.rrc_scale));
        }
        if !(0.0 < self.rrc_ratio[0] && self.rrc_ratio[0] <= self.rrc_ratio[1]) {
            return Err(format!("rrc_ratio {:?} must satisfy 0 < lo <= hi", self.rrc_ratio));
        }
        if self.std.iter().any(|&s| s <= 0.0) {
            return Err(format!("std {:?} must be positive", self.std));
        }
        Ok(())
    }

    /// Floats per image in the output buffer.
    pub fn numel(&self) -> usize {
        match self.naflex {
            Some(n) => n.numel(),
            None => 3 * self.image_size * self.image_size,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct DecodeError {
    pub reason: &'static str,
    pub detail: String,
}

/// Decodes an image, refusing ones whose header claims more than `max_pixels`. A JPEG at least
/// four times larger than `min_side` on both sides is decoded at a reduced DCT scale (1/4 or 1/8)
/// that still gives at least `min_side` pixels, several times cheaper for large web images.
pub fn decode(bytes: &[u8], min_side: u32, max_pixels: u64, alpha: Alpha) -> Result<RgbImage, DecodeError> {
    let corrupt = |detail: String| DecodeError { reason: reason::CORRUPT_IMAGE, detail };
    if bytes.starts_with(&[0xff, 0xd8]) {
        if !jpeg_is_complete(bytes) {
            return Err(corrupt("JPEG data is truncated (no end-of-image marker after the last scan)".into()));
        }
        if let Some(img) = decode_jpeg_scaled(bytes, min_side, max_pixels)? {
            return Ok(img);
        }
        if min_side == FULL_RESOLUTION {
            if let Some(img) = decode_jpeg_exact(bytes)? {
                return Ok(img);
            }
        }
    }
    let reader = image::ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| corrupt(e.to_string()))?;
    if reader.format().is_none() {
        return Err(corrupt("unrecognised image format".into()));
    }
    let (w, h) = reader.into_dimensions().map_err(|e| corrupt(e.to_string()))?;
    check_pixels(w, h, max_pixels)?;
    let mut reader = image::ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| corrupt(e.to_string()))?;
    let mut limits = image::Limits::default();
    limits.max_alloc = Some(max_pixels.saturating_mul(16).max(1 << 26));
    reader.limits(limits);
    let img = reader.decode().map_err(|e| corrupt(e.to_string()))?;
    if alpha == Alpha::White && img.color().has_alpha() {
        return Ok(over_white(&img.into_rgba8()));
    }
    Ok(img.into_rgb8())
}

/// An RGBA image composited over opaque white, rounded as PIL's `alpha_composite` rounds.
fn over_white(rgba: &image::RgbaImage) -> RgbImage {
    RgbImage::from_fn(rgba.width(), rgba.height(), |x, y| {
        let p = rgba.get_pixel(x, y).0;
        let a = p[3] as u32;
        image::Rgb(std::array::from_fn(|c| ((p[c] as u32 * a + 255 * (255 - a) + 127) / 255) as u8))
    })
}

/// Whether a JPEG's last scan is followed by an end-of-image marker. zune-jpeg decodes a cut-off
/// file without complaint (the missing rows come out grey), so truncation is checked here: inside
/// entropy-coded data every 0xFF byte is stuffed, so FFDA / FFD9 found there are real markers.
/// Embedded EXIF thumbnails end before the main image's scans, so they cannot satisfy the check.
pub fn jpeg_is_complete(bytes: &[u8]) -> bool {
    let Some(last_scan) = bytes.windows(2).rposition(|w| w == [0xff, 0xda]) else { return false };
    bytes[last_scan..].windows(2).any(|w| w == [0xff, 0xd9])
}

fn check_pixels(w: u32, h: u32, max_pixels: u64) -> Result<(), DecodeError> {
    if w == 0 || h == 0 {
        return Err(DecodeError { reason: reason::CORRUPT_IMAGE, detail: format!("empty image {w}x{h}") });
    }
    if w as u64 * h as u64 > max_pixels {
        return Err(DecodeError { reason: reason::IMAGE_TOO_LARGE, detail: format!("{w}x{h} exceeds max_pixels {max_pixels}") });
    }
    Ok(())
}

/// A JPEG decoded as PIL decodes it: libjpeg-turbo's code (through mozjpeg, its fork), whose
/// accurate integer IDCT and fancy chroma upsampling give the very pixels open_clip and
/// transformers see (zune-jpeg's differ by up to 4 levels in a quarter of them). It is slower
/// than zune-jpeg (no SIMD), so only the full-resolution decodes of evaluation, scoring and
/// NaFlex take it; training crops keep the faster decoders. Ok(None) for CMYK / YCCK, which the
/// general decoder converts as PIL does.
fn decode_jpeg_exact(bytes: &[u8]) -> Result<Option<RgbImage>, DecodeError> {
    let decoded = std::panic::catch_unwind(|| -> std::io::Result<Option<RgbImage>> {
        let d = mozjpeg::Decompress::new_mem(bytes)?;
        if matches!(d.color_space(), mozjpeg::ColorSpace::JCS_CMYK | mozjpeg::ColorSpace::JCS_YCCK) {
            return Ok(None);
        }
        let (w, h) = (d.width() as u32, d.height() as u32);
        let mut rgb = d.rgb()?;
        let rows: Vec<[u8; 3]> = rgb.read_scanlines()?;
        rgb.finish()?;
        let img = RgbImage::from_raw(w, h, rows.into_iter().flatten().collect());
        img.map(Some).ok_or_else(|| std::io::Error::other(format!("decoded buffer does not match {w}x{h}")))
    });
    let corrupt = |detail: String| DecodeError { reason: reason::CORRUPT_IMAGE, detail };
    match decoded {
        Ok(Ok(img)) => Ok(img),
        Ok(Err(e)) => Err(corrupt(e.to_string())),
        // libjpeg's fatal errors unwind with their message.
        Err(panic) => Err(corrupt(panic.downcast_ref::<String>().cloned().unwrap_or_else(|| "libjpeg failed".into()))),
    }
}

/// Ok(None) means "let the general decoder do it" (full-scale decodes, CMYK JPEGs).
fn decode_jpeg_scaled(bytes: &[u8], min_side: u32, max_pixels: u64) -> Result<Option<RgbImage>, DecodeError> {
    let corrupt = |detail: String| DecodeError { reason: reason::CORRUPT_IMAGE, detail };
    let mut dec = jpeg_decoder::Decoder::new(Cursor::new(bytes));
    dec.read_info().map_err(|e| corrupt(e.to_string()))?;
    let info = dec.info().ok_or_else(|| corrupt("no JPEG header".into()))?;
    check_pixels(info.width as u32, info.height as u32, max_pixels)?;
    // The decoder picks the smallest scale reaching the request on *one* axis; we need both, so
    // choose the scale here and request exactly its output size.
    let (fw, fh) = (info.width as u32, info.height as u32);
    let denom = [8u32, 4, 2, 1].into_iter().find(|d| fw.div_ceil(*d) >= min_side && fh.div_ceil(*d) >= min_side).unwrap_or(1);
    if denom < 4 {
        // Huffman decoding costs the same at every scale, and zune-jpeg (the image crate's
        // decoder, SIMD) does it faster than jpeg-decoder: measured on 1024 px JPEGs, zune at full
        // size took 4.8 ms against 5.8 ms for jpeg-decoder at 1/2. Scaled decoding pays from 1/4.
        return Ok(None);
    }
    let (w, h) = dec.scale(fw.div_ceil(denom) as u16, fh.div_ceil(denom) as u16).map_err(|e| corrupt(e.to_string()))?;
    let pixels = dec.decode().map_err(|e| corrupt(e.to_string()))?;
    let info = dec.info().ok_or_else(|| corrupt("no JPEG header".into()))?;
    let (w, h) = (w as u32, h as u32);
    let rgb = match info.pixel_format {
        jpeg_decoder::PixelFormat::RGB24 => pixels,
        jpeg_decoder::PixelFormat::L8 => pixels.iter().flat_map(|&v| [v, v, v]).collect(),
        jpeg_decoder::PixelFormat::L16 => pixels.chunks_exact(2).flat_map(|c| [c[0], c[0], c[0]]).collect(),
        jpeg_decoder::PixelFormat::CMYK32 => return Ok(None),
    };
    RgbImage::from_raw(w, h, rgb).map(Some).ok_or_else(|| corrupt(format!("decoded buffer does not match {w}x{h}")))
}

/// A crop rectangle in pixel coordinates of the image it applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rect {
    pub x: u32,
    pub y: u32,
    pub w: u32,
    pub h: u32,
}

/// The largest side an image is resized or cropped to: far beyond any model's input, and small
/// enough that a damaged config cannot ask for gigabytes per image.
pub const MAX_SIDE: usize = 8192;

fn resized_dims(w: u32, h: u32, cfg: &ImageConfig) -> (u32, u32) {
    let r = cfg.resize as u32;
    match cfg.resize_mode {
        ResizeMode::Longer => {
            // open_clip's ResizeKeepRatio: both sides divided by the larger ratio, rounded.
            let ratio = (w as f64 / r as f64).max(h as f64 / r as f64);
            (((w as f64 / ratio).round() as u32).max(1), ((h as f64 / ratio).round() as u32).max(1))
        }
        ResizeMode::Square => (r, r),
        ResizeMode::Shorter => {
            // torchvision: the shorter side becomes r, the longer one int(r * long / short).
            if w <= h {
                (r, ((r as u64 * h as u64) / w as u64) as u32)
            } else {
                (((r as u64 * w as u64) / h as u64) as u32, r)
            }
        }
    }
}

/// The center crop of an image of `w`×`h`, as Hugging Face's `center_crop` places it.
pub fn center_crop(w: u32, h: u32, size: u32) -> Rect {
    center_crop_at(w, h, size, CropOffset::Floor)
}

/// The center crop of an image of `w`×`h`, its odd margin placed as `offset` says.
pub fn center_crop_at(w: u32, h: u32, size: u32, offset: CropOffset) -> Rect {
    let start = |margin: u32| match offset {
        CropOffset::Floor => margin / 2,
        // Half a margin, ties to even: margin 5 starts at 2, margin 7 at 4.
        CropOffset::Round => {
            let half = margin / 2;
            if margin % 2 == 1 && half % 2 == 1 {
                half + 1
            } else {
                half
            }
        }
    };
    Rect { x: start(w.saturating_sub(size)), y: start(h.saturating_sub(size)), w: size.min(w), h: size.min(h) }
}

/// A uniformly placed crop, every valid offset equally likely.
pub fn random_crop(w: u32, h: u32, size: u32, rng: &mut Rng) -> Rect {
    let x = rng.below((w.saturating_sub(size) + 1) as usize) as u32;
    let y = rng.below((h.saturating_sub(size) + 1) as usize) as u32;
    Rect { x, y, w: size.min(w), h: size.min(h) }
}

/// torchvision's RandomResizedCrop box: ten tries at a random area and log-uniform aspect ratio,
/// then a central crop clamped to the ratio range.
pub fn random_resized_crop(w: u32, h: u32, scale: [f64; 2], ratio: [f64; 2], rng: &mut Rng) -> Rect {
    let area = (w as f64) * (h as f64);
    let (lr0, lr1) = (ratio[0].ln(), ratio[1].ln());
    for _ in 0..10 {
        let target = area * rng.uniform(scale[0], scale[1]);
        let ar = rng.uniform(lr0, lr1).exp();
        let cw = (target * ar).sqrt().round() as u32;
        let ch = (target / ar).sqrt().round() as u32;
        if cw > 0 && ch > 0 && cw <= w && ch <= h {
            let x = rng.below((w - cw + 1) as usize) as u32;
            let y = rng.below((h - ch + 1) as usize) as u32;
            return Rect { x, y, w: cw, h: ch };
        }
    }
    let in_ratio = w as f64 / h as f64;
    let (cw, ch) = if in_ratio < ratio[0] {
        (w, ((w as f64 / ratio[0]).round() as u32).min(h))
    } else if in_ratio > ratio[1] {
        (((h as f64 * ratio[1]).round() as u32).min(w), h)
    } else {
        (w, h)
    };
    Rect { x: (w - cw) / 2, y: (h - ch) / 2, w: cw, h: ch }
}

/// Writes `img[rect]` (optionally mirrored) normalised as `(x/255 - mean) / std` into `out`, laid
/// out channel-major (3 × rect.h × rect.w).
pub fn write_chw(img: &RgbImage, rect: Rect, flip: bool, mean: [f32; 3], std: [f32; 3], out: &mut [f32]) {
    let (cw, ch) = (rect.w as usize, rect.h as usize);
    assert_eq!(out.len(), 3 * cw * ch, "output slice does not match the crop");
    let plane = cw * ch;
    let scale: [f32; 3] = std::array::from_fn(|c| 1.0 / (255.0 * std[c]));
    let shift: [f32; 3] = std::array::from_fn(|c| -mean[c] / std[c]);
    let stride = img.width() as usize * 3;
    let raw = img.as_raw();
    for y in 0..ch {
        let row = &raw[(rect.y as usize + y) * stride..][..stride];
        for x in 0..cw {
            let sx = if flip { rect.x as usize + cw - 1 - x } else { rect.x as usize + x };
            let px = &row[sx * 3..sx * 3 + 3];
            for c in 0..3 {
                out[c * plane + y * cw + x] = px[c] as f32 * scale[c] + shift[c];
            }
        }
    }
}

thread_local! {
    // The resizer keeps its scratch buffers between calls; one per loader thread.
    static RESIZER: std::cell::RefCell<fast_image_resize::Resizer> = std::cell::RefCell::new(fast_image_resize::Resizer::new());
}

/// Resizes with SIMD convolution kernels (several times faster than `image::imageops`).
pub fn resize(img: &RgbImage, w: u32, h: u32, interp: Interpolation) -> RgbImage {
    if img.width() == w && img.height() == h {
        return img.clone();
    }
    use fast_image_resize::images::{Image, ImageRef};
    use fast_image_resize::{PixelType, ResizeOptions};
    let src = ImageRef::new(img.width(), img.height(), img.as_raw(), PixelType::U8x3).expect("buffer matches its dimensions");
    let mut dst = Image::new(w, h, PixelType::U8x3);
    RESIZER
        .with(|r| r.borrow_mut().resize(&src, &mut dst, &ResizeOptions::new().resize_alg(interp.algorithm())))
        .expect("same pixel type on both sides");
    RgbImage::from_raw(w, h, dst.into_vec()).expect("resizer output matches its dimensions")
}

/// Decoding at full resolution: what evaluation, `align embed` and `align search` do, as
/// `transformers`' processors decode before they resize.
pub const FULL_RESOLUTION: u32 = u32::MAX;

/// The smallest side a training JPEG may be decoded at without losing detail the transform keeps.
/// Reduced-scale decoding (1/4 or 1/8 of the DCT) is several times faster on large web images;
/// its resize starts from fewer pixels, so it is kept to training, where the images are
/// augmented anyway: an evaluation at reduced scale moved per-image embeddings of large JPEGs
/// by up to 0.025 in cosine.
pub fn decode_min_side(cfg: &ImageConfig, train: bool) -> u32 {
    // A NaFlex image's size follows its aspect ratio: its shorter side may need every pixel.
    if !train || cfg.naflex.is_some() {
        return FULL_RESOLUTION;
    }
    if cfg.train_crop == TrainCrop::RandomResizedCrop {
        (cfg.image_size as f64 / cfg.rrc_scale[0].sqrt()).ceil() as u32
    } else {
        cfg.resize as u32
    }
}

/// An image as NaFlex patches (see `model::naflex`): resized to the budget's size for its aspect
/// ratio, scaled and normalised, cut into patches row by row (each patch's pixels row by row, R
/// G B), zero padding, then the grid's height and width.
pub fn write_naflex(img: &RgbImage, n: Naflex, cfg: &ImageConfig, flip: bool, out: &mut [f32]) {
    let (th, tw) = n.size_for(img.height(), img.width());
    let resized = resize(img, tw, th, cfg.interpolation);
    let p = n.patch_size as u32;
    let (gh, gw) = (th / p, tw / p);
    out.fill(0.0);
    let mut at = 0;
    for py in 0..gh {
        for px in 0..gw {
            for ky in 0..p {
                for kx in 0..p {
                    let x = px * p + kx;
                    let x = if flip { tw - 1 - x } else { x };
                    let pixel = resized.get_pixel(x, py * p + ky).0;
                    for (c, v) in pixel.iter().enumerate() {
                        out[at] = (*v as f32 / 255.0 - cfg.mean[c]) / cfg.std[c];
                        at += 1;
                    }
                }
            }
        }
    }
    let len = out.len();
    out[len - 2] = gh as f32;
    out[len - 1] = gw as f32;
}

/// Training transform: random crop (or random resized crop) and random flip, drawn from `rng`.
/// A NaFlex input takes the random resized crop (or the whole image) at its own aspect ratio.
pub fn train_transform(img: &RgbImage, cfg: &ImageConfig, rng: &mut Rng, out: &mut [f32]) {
    if let Some(n) = cfg.naflex {
        let cropped = match cfg.train_crop {
            TrainCrop::RandomResizedCrop => {
                let r = random_resized_crop(img.width(), img.height(), cfg.rrc_scale, cfg.rrc_ratio, rng);
                image::imageops::crop_imm(img, r.x, r.y, r.w, r.h).to_image()
            }
            TrainCrop::RandomCrop => img.clone(),
        };
        let flip = cfg.hflip && rng.bernoulli(0.5);
        write_naflex(&cropped, n, cfg, flip, out);
        return;
    }
    let s = cfg.image_size as u32;
    match cfg.train_crop {
        TrainCrop::RandomCrop => {
            let (rw, rh) = resized_dims(img.width(), img.height(), cfg);
            let resized = resize(img, rw, rh, cfg.interpolation);
            let rect = random_crop(rw, rh, s, rng);
            let flip = cfg.hflip && rng.bernoulli(0.5);
            write_chw(&resized, rect, flip, cfg.mean, cfg.std, out);
        }
        TrainCrop::RandomResizedCrop => {
            let r = random_resized_crop(img.width(), img.height(), cfg.rrc_scale, cfg.rrc_ratio, rng);
            let cropped = image::imageops::crop_imm(img, r.x, r.y, r.w, r.h).to_image();
            let resized = resize(&cropped, s, s, cfg.interpolation);
            let flip = cfg.hflip && rng.bernoulli(0.5);
            write_chw(&resized, Rect { x: 0, y: 0, w: s, h: s }, flip, cfg.mean, cfg.std, out);
        }
    }
}

/// Evaluation transform: deterministic resize and center crop (or, resizing the longer side,
/// centred padding with black).
pub fn eval_transform(img: &RgbImage, cfg: &ImageConfig, out: &mut [f32]) {
    if let Some(n) = cfg.naflex {
        write_naflex(img, n, cfg, false, out);
        return;
    }
    let s = cfg.image_size as u32;
    let (rw, rh) = resized_dims(img.width(), img.height(), cfg);
    if cfg.resize_mode == ResizeMode::Longer {
        let resized = resize(img, rw.min(s), rh.min(s), cfg.interpolation);
        let mut padded = RgbImage::new(s, s);
        // open_clip's CenterCropOrPad: the odd pixel of padding goes right and below.
        let (x, y) = ((s - resized.width()) / 2, (s - resized.height()) / 2);
        image::imageops::replace(&mut padded, &resized, x as i64, y as i64);
        write_chw(&padded, Rect { x: 0, y: 0, w: s, h: s }, false, cfg.mean, cfg.std, out);
        return;
    }
    let resized = resize(img, rw.max(s), rh.max(s), cfg.interpolation);
    let rect = center_crop_at(resized.width(), resized.height(), s, cfg.crop_offset);
    write_chw(&resized, rect, false, cfg.mean, cfg.std, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gradient_image(w: u32, h: u32) -> RgbImage {
        RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, (x + y) as u8]))
    }

    #[test]
    fn normalisation_matches_hand_computed_pixels() {
        let img = RgbImage::from_fn(2, 1, |x, _| if x == 0 { image::Rgb([0, 127, 255]) } else { image::Rgb([51, 102, 204]) });
        let mut out = vec![0.0; 6];
        write_chw(&img, Rect { x: 0, y: 0, w: 2, h: 1 }, false, [0.5; 3], [0.5; 3], &mut out);
        // ALIGN scaling x / 127.5 - 1.
        let want = [-1.0, 51.0 / 127.5 - 1.0, 127.0 / 127.5 - 1.0, 102.0 / 127.5 - 1.0, 1.0, 204.0 / 127.5 - 1.0];
        for (g, w) in out.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{out:?}");
        }
        let mut out = vec![0.0; 3];
        write_chw(&img, Rect { x: 1, y: 0, w: 1, h: 1 }, false, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225], &mut out);
        assert!((out[0] - (0.2 - 0.485) / 0.229).abs() < 1e-5);
        assert!((out[2] - (0.8 - 0.406) / 0.225).abs() < 1e-5);
    }

    #[test]
    fn flip_mirrors_columns_of_the_crop() {
        let img = gradient_image(8, 4);
        let rect = Rect { x: 2, y: 1, w: 4, h: 2 };
        let (mut a, mut b) = (vec![0.0; 24], vec![0.0; 24]);
        write_chw(&img, rect, false, [0.0; 3], [1.0 / 255.0; 3], &mut a);
        write_chw(&img, rect, true, [0.0; 3], [1.0 / 255.0; 3], &mut b);
        // Channel 0 holds x: row 0 is 2,3,4,5 and mirrored 5,4,3,2.
        assert_eq!(&a[0..4], &[2.0, 3.0, 4.0, 5.0]);
        assert_eq!(&b[0..4], &[5.0, 4.0, 3.0, 2.0]);
        // Channel 1 holds y: rows start at the crop's top.
        assert_eq!(a[8], 1.0);
        assert_eq!(a[12], 2.0);
    }

    #[test]
    fn random_crops_stay_inside_and_reach_every_corner() {
        let mut rng = Rng::new(0);
        let (mut min_x, mut max_x) = (u32::MAX, 0);
        for _ in 0..2000 {
            let r = random_crop(346, 346, 289, &mut rng);
            assert!(r.x + r.w <= 346 && r.y + r.h <= 346 && r.w == 289);
            min_x = min_x.min(r.x);
            max_x = max_x.max(r.x);
        }
        assert_eq!((min_x, max_x), (0, 57));
    }

    #[test]
    fn random_resized_crops_respect_scale_and_ratio() {
        let mut rng = Rng::new(1);
        for _ in 0..500 {
            let r = random_resized_crop(640, 480, [0.3, 1.0], [0.75, 4.0 / 3.0], &mut rng);
            assert!(r.x + r.w <= 640 && r.y + r.h <= 480);
            let frac = (r.w * r.h) as f64 / (640.0 * 480.0);
            assert!(frac > 0.28 && frac <= 1.0, "{r:?}");
        }
        // A panorama cannot hold a 3:4..4:3 crop of full area: the fallback clamps to the ratio.
        let r = random_resized_crop(1000, 100, [0.99, 1.0], [0.75, 4.0 / 3.0], &mut Rng::new(2));
        assert_eq!((r.w, r.h), (133, 100));
    }

    #[test]
    fn center_crop_places_the_odd_pixel_like_hugging_face() {
        assert_eq!(center_crop(346, 346, 289), Rect { x: 28, y: 28, w: 289, h: 289 });
        assert_eq!(center_crop(300, 289, 289), Rect { x: 5, y: 0, w: 289, h: 289 });
    }

    #[test]
    fn torchvision_centre_crops_round_half_margins_to_even() {
        // torchvision: int(round((h - c) / 2.0)); Python rounds 2.5 to 2 and 3.5 to 4.
        for (margin, start) in [(0, 0), (1, 0), (2, 1), (3, 2), (5, 2), (7, 4), (9, 4), (11, 6)] {
            assert_eq!(center_crop_at(10 + margin, 10, 10, CropOffset::Round).x, start, "margin {margin}");
        }
        assert_eq!(center_crop_at(15, 10, 10, CropOffset::Floor).x, 2);
    }

    #[test]
    fn the_longer_side_mode_pads_a_tall_image_with_black() {
        let img = RgbImage::from_pixel(10, 40, image::Rgb([255, 255, 255]));
        let cfg =
            ImageConfig { image_size: 8, resize: 8, resize_mode: ResizeMode::Longer, mean: [0.0; 3], std: [1.0; 3], ..Default::default() };
        let mut out = vec![0.0; cfg.numel()];
        eval_transform(&img, &cfg, &mut out);
        // 10x40 becomes 2x8, placed at columns 3..5 of the black 8x8 square.
        let row: Vec<f32> = out[..8].to_vec();
        assert_eq!(row, vec![0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn eval_transform_of_a_flat_image_is_flat() {
        let img = RgbImage::from_pixel(50, 30, image::Rgb([255, 0, 127]));
        let cfg = ImageConfig { image_size: 16, resize: 20, resize_mode: ResizeMode::Shorter, ..Default::default() };
        let mut out = vec![0.0; cfg.numel()];
        eval_transform(&img, &cfg, &mut out);
        assert!(out[..256].iter().all(|&v| (v - 1.0).abs() < 1e-6));
        assert!(out[256..512].iter().all(|&v| (v + 1.0).abs() < 1e-6));
    }

    #[test]
    fn decoding_rejects_garbage_and_bombs_and_scales_jpegs() {
        assert_eq!(decode(b"not an image", 10, 1 << 30, Alpha::Drop).unwrap_err().reason, "corrupt_image");
        let img = gradient_image(200, 120);
        let mut jpg = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut jpg, 90).encode_image(&img).unwrap();
        assert_eq!(decode(&jpg, 10, 100, Alpha::Drop).unwrap_err().reason, "image_too_large");
        // 30 px allows 1/4 scale (50x30); 40 px only 1/2, which is not worth a scaled decode.
        assert_eq!(decode(&jpg, 30, 1 << 30, Alpha::Drop).unwrap().dimensions(), (50, 30));
        assert_eq!(decode(&jpg, 15, 1 << 30, Alpha::Drop).unwrap().dimensions(), (25, 15));
        assert_eq!(decode(&jpg, 40, 1 << 30, Alpha::Drop).unwrap().dimensions(), (200, 120));
        let full = decode(&jpg, 500, 1 << 30, Alpha::Drop).unwrap();
        assert_eq!(full.dimensions(), (200, 120));
        let truncated = &jpg[..jpg.len() / 3];
        assert!(decode(truncated, 500, 1 << 30, Alpha::Drop).is_err());
        let mut png = Vec::new();
        img.write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png).unwrap();
        assert_eq!(decode(&png, 10, 1 << 30, Alpha::Drop).unwrap().dimensions(), (200, 120));
    }

    /// JPEGs of every common form (4:2:0, 4:2:2, 4:4:4, progressive, restart markers, greyscale;
    /// odd sizes) decode at full resolution to exactly the pixels PIL gives
    /// (`scripts/make_jpeg_fixtures.py`); a corrupt one is an error naming libjpeg's complaint.
    #[test]
    fn full_resolution_jpegs_decode_to_pils_pixels() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jpeg");
        let mut checked = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "jpg") {
                continue;
            }
            let img = decode(&std::fs::read(&path).unwrap(), FULL_RESOLUTION, 1 << 30, Alpha::Drop).unwrap();
            let want = std::fs::read(path.with_extension("rgb")).unwrap();
            let differ = img.as_raw().iter().zip(&want).filter(|(a, b)| a != b).count();
            assert!(
                img.as_raw().len() == want.len() && differ == 0,
                "{}: {differ} of {} values differ from PIL's",
                path.display(),
                want.len()
            );
            checked += 1;
        }
        assert_eq!(checked, 6);
        let mut bytes = std::fs::read(dir.join("q75-420-37x23.jpg")).unwrap();
        // A broken quantisation table reference, the file still ending as a JPEG does.
        let sof = bytes.windows(2).position(|w| w == [0xff, 0xc0]).unwrap();
        bytes[sof + 12] = 9;
        let e = decode(&bytes, FULL_RESOLUTION, 1 << 30, Alpha::Drop).unwrap_err();
        assert_eq!(e.reason, reason::CORRUPT_IMAGE, "{e:?}");
    }
}
