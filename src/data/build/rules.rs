//! The per-sample part of `align data build`'s pass, run in parallel: each sample's image header,
//! geometry, caption and frequency rules, and what needs its pixels (decoding, the near-duplicate
//! index, resizing and re-encoding), ending in a verdict: what to write, or the first filter it
//! fails.

use std::io::Cursor;

use xxhash_rust::xxh3::xxh3_128;

use super::corpus::{caption_key, Counts};
use super::filter::Filter;
use super::filters::{self, Filters};
use super::input::Candidate;
use super::phash::{self, NearIndex};
use crate::data::curate::metaclip::Matcher;
use crate::data::transform::{self, Interpolation};

/// The result of the per-sample (parallel) part of the filtering.
pub(super) struct Checked {
    pub key: String,
    pub origin: String,
    /// The input's caption as it came, which a score must have been computed on.
    pub caption: String,
    pub words: usize,
    pub dims: Option<(u32, u32)>,
    pub verdict: Result<Prepared, Failed>,
}

pub(super) struct Prepared {
    /// The MetaCLIP entries the caption matches.
    pub matched: Vec<u32>,
    pub caption: String,
    pub image: Vec<u8>,
    pub ext: &'static str,
    pub json: Option<Vec<u8>>,
    pub image_hash: u128,
    pub near_eval: Option<u32>,
}

fn format_name(fmt: image::ImageFormat) -> &'static str {
    fmt.extensions_str().first().copied().unwrap_or("img")
}

/// A filter's verdict against a sample: the filter's name and what it found.
pub(super) type Failed = (Filter, String);

/// The image's format and size, read from its header.
struct Header {
    fmt: image::ImageFormat,
    name: &'static str,
    w: u32,
    h: u32,
}

impl Header {
    fn sides(&self) -> (u32, u32) {
        (self.w.min(self.h), self.w.max(self.h))
    }
}

pub(super) fn check(s: Candidate, f: &Filters, counts: &Counts, near: &NearIndex, matcher: Option<&Matcher>) -> Checked {
    let caption = filters::trim_boilerplate(&s.caption, &f.text.trim_boilerplate);
    let words = filters::word_count(&caption);
    let mut out = Checked {
        key: s.key,
        origin: s.origin,
        caption: s.caption.clone(),
        words,
        dims: None,
        verdict: Err((Filter::Unreadable, String::new())),
    };
    let header = match read_header(&s.image, f) {
        Ok(h) => h,
        Err(e) => {
            out.verdict = Err(e);
            return out;
        }
    };
    out.dims = Some((header.w, header.h));
    let (image, json) = (s.image, s.json);
    out.verdict = check_geometry(&header, f)
        .and_then(|()| check_caption(&caption, words, f, counts))
        .and_then(|()| check_frequency(&caption, xxh3_128(&image), f, counts))
        .and_then(|image_hash| {
            let (image, ext, near_eval) = pixels(image, &header, f, near)?;
            let matched = matcher.map(|m| m.matches(&caption)).unwrap_or_default();
            Ok(Prepared { matched, caption, image, ext, json, image_hash, near_eval })
        });
    out
}

/// The format (one of the allowed ones) and size from the image's header.
fn read_header(image: &[u8], f: &Filters) -> Result<Header, Failed> {
    let fmt = image::guess_format(image).map_err(|_| (Filter::Undecodable, "unrecognised image format".to_string()))?;
    let name = format_name(fmt);
    if !f.image.formats.is_empty() && !f.image.formats.iter().any(|x| image::ImageFormat::from_extension(x) == Some(fmt)) {
        return Err((Filter::ImageFormat, format!("{name} is not among {:?}", f.image.formats)));
    }
    let (w, h) = image::ImageReader::with_format(Cursor::new(image), fmt)
        .into_dimensions()
        .map_err(|_| (Filter::Undecodable, format!("unreadable {name} header")))?;
    Ok(Header { fmt, name, w, h })
}

/// The shorter side and the aspect ratio.
fn check_geometry(header: &Header, f: &Filters) -> Result<(), Failed> {
    let (w, h) = (header.w, header.h);
    let (short, long) = header.sides();
    if short <= f.image.min_shorter_side {
        return Err((Filter::ImageSize, format!("{w}×{h}: shorter side not above {}", f.image.min_shorter_side)));
    }
    let aspect = long as f64 / short.max(1) as f64;
    let limit = f.image.max_aspect_ratio;
    if limit > 0.0 && (aspect > limit || (!f.image.aspect_ratio_inclusive && aspect >= limit)) {
        return Err((Filter::AspectRatio, format!("{w}×{h}: aspect ratio {aspect:.2} over {limit}")));
    }
    Ok(())
}

/// The caption's filters, in order: boilerplate, word count, repeated words, capitalisation,
/// rare tokens.
fn check_caption(caption: &str, words: usize, f: &Filters, counts: &Counts) -> Result<(), Failed> {
    let t = &f.text;
    if filters::has_boilerplate(caption, &t.drop_boilerplate) {
        return Err((Filter::Boilerplate, format!("{caption:?} starts or ends with boilerplate")));
    }
    if words < t.min_words.max(1) || (t.max_words > 0 && words > t.max_words) {
        return Err((Filter::WordCount, format!("{words} words")));
    }
    if t.max_repeated_fraction > 0.0 && filters::repeated_fraction(caption) > t.max_repeated_fraction {
        return Err((Filter::RepeatedWords, format!("{:.2} of the words repeat", filters::repeated_fraction(caption))));
    }
    if (t.require_capitalized_first_word && !filters::first_word_capitalized(caption))
        || (t.max_capitalized_fraction > 0.0 && filters::capitalized_fraction(caption) > t.max_capitalized_fraction)
    {
        return Err((Filter::Capitalization, format!("{caption:?}")));
    }
    let normed = filters::norm_words(caption);
    if t.rare.min_count > 0 {
        if let Some(w) = normed.iter().find(|w| counts.words.get(*w).copied().unwrap_or(0) < t.rare.min_count) {
            return Err((Filter::RareTokens, format!("{w:?} occurs fewer than {} times", t.rare.min_count)));
        }
    }
    if let Some(top) = &counts.top_ngrams {
        if let Some(g) = filters::ngrams(&normed).find(|g| !top.contains(g)) {
            return Err((Filter::RareTokens, format!("{g:?} is not among the {} most frequent n-grams", t.rare.top_ngrams)));
        }
    }
    Ok(())
}

/// Captions shared by too many images, images with too many captions; the image's hash.
fn check_frequency(caption: &str, image_hash: u128, f: &Filters, counts: &Counts) -> Result<u128, Failed> {
    let fq = &f.frequency;
    if fq.max_images_per_caption > 0 {
        let n = counts.caption_images.get(&caption_key(caption)).copied().unwrap_or(0);
        if n as u64 > fq.max_images_per_caption {
            return Err((Filter::CaptionFrequency, format!("caption shared by {n} images")));
        }
    }
    if fq.max_captions_per_image > 0 {
        let n = counts.image_captions.get(&image_hash).copied().unwrap_or(0);
        if n as u64 > fq.max_captions_per_image {
            return Err((Filter::ImageFrequency, format!("image has {n} captions")));
        }
    }
    Ok(image_hash)
}

/// What needs the pixels: decodability, the near-duplicate index, resizing and re-encoding.
/// Returns the bytes to write, their extension and the nearest evaluation image, if any.
fn pixels(image: Vec<u8>, header: &Header, f: &Filters, near: &NearIndex) -> Result<(Vec<u8>, &'static str, Option<u32>), Failed> {
    let o = &f.output;
    let (w, h) = (header.w, header.h);
    let long = header.sides().1;
    let resize = o.resize_longer > 0 && long > o.resize_longer;
    let ext = if header.fmt == image::ImageFormat::Jpeg { "jpg" } else { header.name };
    if !(f.image.require_decodable || resize || o.reencode_jpeg || !near.is_empty()) {
        return Ok((image, ext, None));
    }
    // Full resolution only when writing pixels; the checks are fine at reduced DCT scale.
    let min_side = if resize || o.reencode_jpeg { u32::MAX } else { 64 };
    let pixels =
        transform::decode(&image, min_side, f.image.max_pixels, transform::Alpha::Drop).map_err(|e| (Filter::Undecodable, e.detail))?;
    let near_eval = if near.is_empty() { None } else { near.nearest_within(phash::phash(&pixels), f.dedup.near_max_distance) };
    if !(resize || o.reencode_jpeg) {
        return Ok((image, ext, near_eval));
    }
    let pixels = if resize {
        let scale = o.resize_longer as f64 / long as f64;
        let (nw, nh) = (((w as f64 * scale).round() as u32).max(1), ((h as f64 * scale).round() as u32).max(1));
        transform::resize(&pixels, nw, nh, Interpolation::Bicubic)
    } else {
        pixels
    };
    let mut buf = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut buf, o.jpeg_quality)
        .encode_image(&pixels)
        .map_err(|e| (Filter::Undecodable, format!("re-encoding: {e}")))?;
    Ok((buf, "jpg", near_eval))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32) -> Vec<u8> {
        let mut buf = Vec::new();
        image::RgbImage::from_pixel(w, h, image::Rgb([200, 30, 30])).write_to(&mut Cursor::new(&mut buf), image::ImageFormat::Png).unwrap();
        buf
    }

    fn sample(caption: &str, image: Vec<u8>) -> Candidate {
        Candidate { origin: "in.tsv".into(), key: "k".into(), image, caption: caption.into(), json: None }
    }

    fn verdict(c: Candidate, f: &Filters, counts: &Counts) -> Result<(), (Filter, String)> {
        check(c, f, counts, &NearIndex::default(), None).verdict.map(|_| ())
    }

    /// Each rule charges its own filter, in the order the report lists them: the image's header,
    /// its geometry, then the caption's rules, then the corpus frequencies.
    #[test]
    fn each_rule_names_its_filter_and_the_first_failure_wins() {
        let mut f = Filters::default();
        f.image.min_shorter_side = 20;
        f.image.max_aspect_ratio = 3.0;
        f.text.min_words = 2;
        f.frequency.max_images_per_caption = 1;
        let mut counts = Counts::default();
        counts.caption_images.insert(caption_key("a shared caption"), 2);
        let ok = |c: &str| verdict(sample(c, png(40, 30)), &f, &counts);
        assert_eq!(ok("a red square"), Ok(()));
        assert_eq!(verdict(sample("a red square", b"not an image".to_vec()), &f, &counts).unwrap_err().0, Filter::Undecodable);
        assert_eq!(verdict(sample("a red square", png(20, 30)), &f, &counts).unwrap_err().0, Filter::ImageSize);
        assert_eq!(verdict(sample("a red square", png(100, 30)), &f, &counts).unwrap_err().0, Filter::AspectRatio);
        assert_eq!(ok("red").unwrap_err().0, Filter::WordCount);
        assert_eq!(ok("A  shared caption").unwrap_err().0, Filter::CaptionFrequency, "captions compare folded");
        // A small image with a one-word caption fails on its size first.
        assert_eq!(verdict(sample("red", png(10, 10)), &f, &counts).unwrap_err().0, Filter::ImageSize);
        let jpeg_only =
            Filters { image: crate::data::build::filters::ImageFilters { formats: vec!["jpg".into()], ..f.image.clone() }, ..f.clone() };
        let e = verdict(sample("a red square", png(40, 30)), &jpeg_only, &counts).unwrap_err();
        assert_eq!(e, (Filter::ImageFormat, "png is not among [\"jpg\"]".into()));
    }
}
