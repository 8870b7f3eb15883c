//! The filter file (`configs/filters/NAME.toml`): which filters run and their thresholds, plus
//! the caption rules that need no corpus statistics (boilerplate, word counts, repetition,
//! capitalisation) and the word/bigram splitting the rare-token rule counts with.

use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Filters {
    /// Free text naming the recipe (printed in the report).
    pub description: String,
    pub image: ImageFilters,
    pub text: TextFilters,
    pub frequency: FrequencyFilters,
    pub dedup: DedupFilters,
    /// Model-based curation: CLIP-score filters, MetaCLIP balancing, semantic deduplication.
    pub curate: CurateFilters,
    pub output: OutputOptions,
}

/// The model-based filters, applied after the rule filters in this order: CLIP score, DataComp's
/// image-based filter, MetaCLIP balancing, semantic deduplication.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CurateFilters {
    /// The score files of the input (`align data score --out DIR`), which the CLIP-score filters
    /// and deduplication read.
    pub scores: std::path::PathBuf,
    /// Keep samples whose image-text cosine is at least this (0: off; LAION-400M 0.3, LAION-5B
    /// 0.28 with OpenAI's ViT-B/32).
    pub min_score: f64,
    /// Keep the samples in the top this fraction of the whole input by score (0: off; DataComp's
    /// best simple baseline: 0.3). With `min_score` too, both must hold.
    pub top_fraction: f64,
    /// The fraction of the input whose key is in the score files with another caption (another
    /// dataset's sample under the same key) that the build tolerates; such samples are never
    /// kept. Above it the build fails. 0: any such sample is an error.
    pub max_caption_mismatch: f64,
    pub image_based: ImageBasedFilter,
    pub metaclip: MetaClipFilter,
    pub semdedup: SemDedupFilter,
}

/// DataComp's image-based filter (`data::curate::image_based`) over the score files' image
/// embeddings.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ImageBasedFilter {
    /// The target set's image embeddings by the checkpoint that scored the input: an
    /// `align embed --data TARGET --out FILE.safetensors` output (DataComp: ImageNet's training
    /// images).
    pub target: std::path::PathBuf,
    /// k-means clusters over the input's image embeddings (0: off; DataComp: 100,000 for its
    /// 12.8M-sample pool).
    pub clusters: usize,
    pub seed: u64,
}

/// MetaCLIP's balancing (`data::curate::metaclip`).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetaClipFilter {
    /// Metadata entries, one per line (UTF-8).
    pub entries: std::path::PathBuf,
    /// The cap per entry (0: off; MetaCLIP 400M: 20,000).
    pub t: u64,
    pub seed: u64,
}

/// SemDeDup (`data::curate::semdedup`) over the score files' image embeddings.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct SemDedupFilter {
    /// k-means clusters (0: off).
    pub clusters: usize,
    /// Cosine similarity at which two images are duplicates.
    pub threshold: f32,
    pub seed: u64,
}

impl Default for SemDedupFilter {
    fn default() -> Self {
        SemDedupFilter { clusters: 0, threshold: 0.95, seed: 0 }
    }
}

impl CurateFilters {
    pub fn needs_scores(&self) -> bool {
        self.min_score > 0.0 || self.top_fraction > 0.0 || self.needs_embeddings()
    }

    /// Whether a filter reads the score files' image embeddings.
    pub fn needs_embeddings(&self) -> bool {
        self.semdedup.clusters > 0 || self.image_based.clusters > 0
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ImageFilters {
    /// Formats kept, by content (`jpeg`, `png`, `webp`, `gif`, ...); empty keeps every format.
    pub formats: Vec<String>,
    /// Keep only images whose shorter side is greater than this many pixels (0: off).
    pub min_shorter_side: u32,
    /// Keep only images whose larger / smaller side ratio is below this (0: off) ...
    pub max_aspect_ratio: f64,
    /// ... or at most this, when true (CC3M: "no more than 2"; ALIGN: "smaller than 3").
    pub aspect_ratio_inclusive: bool,
    /// Drop images that do not decode completely.
    pub require_decodable: bool,
    /// Images whose header claims more pixels than this are dropped undecoded.
    pub max_pixels: u64,
}

impl Default for ImageFilters {
    fn default() -> Self {
        ImageFilters {
            formats: Vec::new(),
            min_shorter_side: 0,
            max_aspect_ratio: 0.0,
            aspect_ratio_inclusive: false,
            require_decodable: true,
            max_pixels: 89_478_485,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TextFilters {
    /// Phrases cropped when a caption starts or ends with them (case-insensitive), with the
    /// separators (` - `, `|`, `:` ...) around them.
    pub trim_boilerplate: Vec<String>,
    /// Captions that start or end with one of these (case-insensitive) are dropped.
    pub drop_boilerplate: Vec<String>,
    /// Word-count range, inclusive (0: no bound).
    pub min_words: usize,
    pub max_words: usize,
    /// Largest allowed fraction of words that repeat an earlier word (0: off; CC12M 0.2).
    pub max_repeated_fraction: f64,
    /// Drop captions whose first word starts with a lower-case letter (CC3M).
    pub require_capitalized_first_word: bool,
    /// Largest allowed fraction of capitalised words (0: off).
    pub max_capitalized_fraction: f64,
    pub rare: RareTokens,
}

/// The rare-token rule, counted over the input corpus in a first pass.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RareTokens {
    /// Drop captions with a word seen fewer than this many times in the corpus (CC3M 5, CC12M 20;
    /// 0: off).
    pub min_count: u64,
    /// Drop captions with a unigram or bigram outside the corpus's most frequent this-many
    /// (ALIGN: 100 million; 0: off).
    pub top_ngrams: u64,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct FrequencyFilters {
    /// Drop captions shared by more than this many distinct images (ALIGN 10; 0: off).
    pub max_images_per_caption: u64,
    /// Drop images (by content hash) paired with more than this many distinct captions (ALIGN
    /// 1000; 0: off).
    pub max_captions_per_image: u64,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DedupFilters {
    /// Keep only the first sample of each exact image (content hash).
    pub exact_images: bool,
    /// Near-duplicates of evaluation images (`--exclude-near`): largest Hamming distance between
    /// 64-bit perceptual hashes that still counts as the same image.
    pub near_max_distance: u32,
}

impl Default for DedupFilters {
    fn default() -> Self {
        DedupFilters { exact_images: false, near_max_distance: 10 }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct OutputOptions {
    pub samples_per_shard: usize,
    /// Resize so the longer side is at most this many pixels, re-encoding as JPEG (0: keep).
    pub resize_longer: u32,
    /// Re-encode every image as JPEG even when not resized.
    pub reencode_jpeg: bool,
    pub jpeg_quality: u8,
    /// Shuffle samples across all output shards.
    pub shuffle: bool,
    pub seed: u64,
}

impl Default for OutputOptions {
    fn default() -> Self {
        OutputOptions { samples_per_shard: 10_000, resize_longer: 0, reencode_jpeg: false, jpeg_quality: 95, shuffle: false, seed: 0 }
    }
}

impl Filters {
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading filter file {}", path.display()))?;
        let f: Filters = toml::from_str(&text).with_context(|| format!("filter file {}", path.display()))?;
        f.validate().with_context(|| format!("filter file {}", path.display()))?;
        Ok(f)
    }

    pub fn validate(&self) -> Result<()> {
        let c = &self.curate;
        anyhow::ensure!((0.0..=1.0).contains(&c.top_fraction), "curate.top_fraction must be in [0, 1] (0: off)");
        anyhow::ensure!((-1.0..=1.0).contains(&c.min_score), "curate.min_score must be a cosine in [-1, 1] (0: off)");
        anyhow::ensure!((0.0..=1.0).contains(&c.max_caption_mismatch), "curate.max_caption_mismatch must be a fraction in [0, 1]");
        anyhow::ensure!(
            !c.needs_scores() || !c.scores.as_os_str().is_empty(),
            "curate.min_score, curate.top_fraction, curate.image_based and curate.semdedup read scores: set curate.scores to the directory `align data score --out` wrote"
        );
        anyhow::ensure!(
            c.image_based.clusters == 0 || !c.image_based.target.as_os_str().is_empty(),
            "curate.image_based keeps samples near a target set: set curate.image_based.target to its `align embed` output"
        );
        anyhow::ensure!(
            c.metaclip.t == 0 || !c.metaclip.entries.as_os_str().is_empty(),
            "curate.metaclip.t balances over metadata entries: set curate.metaclip.entries to a file of them"
        );
        anyhow::ensure!((-1.0..=1.0).contains(&c.semdedup.threshold), "curate.semdedup.threshold must be a cosine in [-1, 1]");
        let t = &self.text;
        anyhow::ensure!(
            t.max_words == 0 || t.min_words <= t.max_words,
            "text.min_words {} exceeds text.max_words {}",
            t.min_words,
            t.max_words
        );
        anyhow::ensure!((0.0..=1.0).contains(&t.max_repeated_fraction), "text.max_repeated_fraction must be in [0, 1]");
        anyhow::ensure!((0.0..=1.0).contains(&t.max_capitalized_fraction), "text.max_capitalized_fraction must be in [0, 1]");
        anyhow::ensure!(
            self.image.max_aspect_ratio == 0.0 || self.image.max_aspect_ratio >= 1.0,
            "image.max_aspect_ratio must be 0 (off) or at least 1"
        );
        anyhow::ensure!(self.output.samples_per_shard > 0, "output.samples_per_shard must be positive");
        anyhow::ensure!((1..=100).contains(&self.output.jpeg_quality), "output.jpeg_quality must be in 1..=100");
        for f in &self.image.formats {
            anyhow::ensure!(image::ImageFormat::from_extension(f).is_some(), "image.formats: unknown format {f:?}");
        }
        Ok(())
    }

    /// Whether a first pass over the corpus is needed for counts.
    pub fn needs_counts(&self) -> bool {
        self.curate.metaclip.t > 0
            || self.text.rare.min_count > 0
            || self.text.rare.top_ngrams > 0
            || self.frequency.max_images_per_caption > 0
            || self.frequency.max_captions_per_image > 0
    }
}

fn starts_with_ci(s: &str, p: &str) -> bool {
    s.len() >= p.len() && s.is_char_boundary(p.len()) && s[..p.len()].eq_ignore_ascii_case(p)
}

fn ends_with_ci(s: &str, p: &str) -> bool {
    s.len() >= p.len() && s.is_char_boundary(s.len() - p.len()) && s[s.len() - p.len()..].eq_ignore_ascii_case(p)
}

const SEPARATORS: &[char] = &[' ', '-', '|', ':', ',', '.', ';', '/', '\u{2013}', '\u{2014}', '\t'];

/// Crops boilerplate phrases from either end, repeatedly, with the separators left around them.
pub fn trim_boilerplate(caption: &str, phrases: &[String]) -> String {
    let mut s = caption.trim();
    loop {
        let before = s.len();
        for p in phrases.iter().map(|p| p.trim()).filter(|p| !p.is_empty()) {
            if starts_with_ci(s, p) {
                s = s[p.len()..].trim_start_matches(SEPARATORS);
            }
            if ends_with_ci(s, p) {
                s = s[..s.len() - p.len()].trim_end_matches(SEPARATORS);
            }
        }
        if s.len() == before {
            return s.trim().to_string();
        }
    }
}

pub fn has_boilerplate(caption: &str, patterns: &[String]) -> bool {
    let s = caption.trim();
    patterns.iter().map(|p| p.trim()).filter(|p| !p.is_empty()).any(|p| starts_with_ci(s, p) || ends_with_ci(s, p))
}

/// Whitespace-separated words, as the word-count rules count them.
pub fn word_count(caption: &str) -> usize {
    caption.split_whitespace().count()
}

/// Normalised words for counting: lower-cased, punctuation stripped from both ends, empty ones
/// dropped.
pub fn norm_words(caption: &str) -> Vec<String> {
    caption.split_whitespace().map(|w| w.trim_matches(|c: char| !c.is_alphanumeric()).to_lowercase()).filter(|w| !w.is_empty()).collect()
}

/// Unigrams and bigrams (`a b`) of a caption's normalised words.
pub fn ngrams(words: &[String]) -> impl Iterator<Item = String> + '_ {
    words.iter().cloned().chain(words.windows(2).map(|w| format!("{} {}", w[0], w[1])))
}

/// Fraction of words that repeat an earlier word of the caption.
pub fn repeated_fraction(caption: &str) -> f64 {
    let words = norm_words(caption);
    if words.is_empty() {
        return 0.0;
    }
    let distinct: std::collections::HashSet<&String> = words.iter().collect();
    (words.len() - distinct.len()) as f64 / words.len() as f64
}

pub fn first_word_capitalized(caption: &str) -> bool {
    caption.trim_start().chars().next().is_none_or(|c| !c.is_lowercase())
}

pub fn capitalized_fraction(caption: &str) -> f64 {
    let words: Vec<&str> = caption.split_whitespace().collect();
    if words.is_empty() {
        return 0.0;
    }
    words.iter().filter(|w| w.chars().next().is_some_and(char::is_uppercase)).count() as f64 / words.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(xs: &[&str]) -> Vec<String> {
        xs.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn boilerplate_is_cropped_from_either_end_with_its_separators() {
        let p = v(&["stock photo", "click to enlarge"]);
        assert_eq!(trim_boilerplate("Stock Photo - a red barn in snow", &p), "a red barn in snow");
        assert_eq!(trim_boilerplate("a red barn in snow | click to enlarge", &p), "a red barn in snow");
        assert_eq!(trim_boilerplate("stock photo: a barn - Stock photo", &p), "a barn");
        assert_eq!(trim_boilerplate("a stock photo of a barn", &p), "a stock photo of a barn");
        assert!(has_boilerplate("Embedded image permalink", &v(&["embedded image permalink"])));
        assert!(has_boilerplate("my new profile photo", &v(&["profile photo"])));
        assert!(!has_boilerplate("a photo of my profile", &v(&["profile photo"])));
    }

    #[test]
    fn caption_statistics_match_hand_counts() {
        assert_eq!(word_count("  a dog  on a beach "), 5);
        assert_eq!(norm_words("The dog, the DOG!"), v(&["the", "dog", "the", "dog"]));
        assert!((repeated_fraction("the dog the dog runs") - 0.4).abs() < 1e-12);
        assert_eq!(repeated_fraction(""), 0.0);
        assert_eq!(ngrams(&v(&["a", "b", "c"])).collect::<Vec<_>>(), v(&["a", "b", "c", "a b", "b c"]));
        assert!(first_word_capitalized("A dog") && first_word_capitalized("3 dogs") && !first_word_capitalized("a dog"));
        assert!((capitalized_fraction("A Dog on the Beach") - 0.6).abs() < 1e-12);
    }

    #[test]
    fn bad_thresholds_are_refused() {
        let mut f = Filters::default();
        f.text.min_words = 5;
        f.text.max_words = 3;
        assert!(f.validate().unwrap_err().to_string().contains("min_words"));
        let mut f = Filters::default();
        f.image.formats = vec!["jpg-ish".into()];
        assert!(f.validate().is_err());
    }

    #[test]
    fn the_presets_parse_and_carry_the_papers_numbers() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/filters");
        let align = Filters::load(&root.join("align.toml")).unwrap();
        assert_eq!((align.image.min_shorter_side, align.image.max_aspect_ratio, align.image.aspect_ratio_inclusive), (200, 3.0, false));
        assert_eq!((align.text.min_words, align.text.max_words, align.text.rare.top_ngrams), (3, 20, 100_000_000));
        assert_eq!((align.frequency.max_images_per_caption, align.frequency.max_captions_per_image), (10, 1000));
        let cc3m = Filters::load(&root.join("cc3m.toml")).unwrap();
        assert_eq!(cc3m.image.formats, v(&["jpeg"]));
        assert_eq!((cc3m.image.min_shorter_side, cc3m.image.max_aspect_ratio, cc3m.image.aspect_ratio_inclusive), (400, 2.0, true));
        assert_eq!(cc3m.text.rare.min_count, 5);
        assert!(cc3m.text.require_capitalized_first_word);
        let cc12m = Filters::load(&root.join("cc12m.toml")).unwrap();
        assert_eq!((cc12m.image.max_aspect_ratio, cc12m.text.min_words, cc12m.text.max_words), (2.5, 3, 256));
        assert_eq!((cc12m.text.max_repeated_fraction, cc12m.text.rare.min_count), (0.2, 20));
        assert!(!cc12m.text.require_capitalized_first_word);
        let curated = Filters::load(&root.join("datacomp-metaclip.toml")).unwrap();
        assert_eq!((curated.curate.top_fraction, curated.curate.metaclip.t, curated.curate.semdedup.threshold), (0.3, 20_000, 0.95));
        let entries = Path::new(env!("CARGO_MANIFEST_DIR")).join(&curated.curate.metaclip.entries);
        assert!(crate::data::curate::metaclip::Matcher::from_file(&entries).unwrap().entries.len() >= 20);
    }
}
