//! The filters of `align data build`, in the order they are applied: a removed sample is charged
//! to the first it fails, and the report lists removals in this order.

/// One filter, as the report and the logs name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Filter {
    /// The input could not be read as a sample (a missing image file, a broken row).
    Unreadable,
    /// The image's format is not among `image.formats`.
    ImageFormat,
    /// The shorter side is not above `image.min_shorter_side`.
    ImageSize,
    /// The aspect ratio is over `image.max_aspect_ratio`.
    AspectRatio,
    /// The caption starts or ends with boilerplate (`text.drop_boilerplate`).
    Boilerplate,
    /// Too few or too many words.
    WordCount,
    /// Too many of the words repeat.
    RepeatedWords,
    /// The capitalisation rules.
    Capitalization,
    /// A word rarer than `text.rare.min_count`, or an n-gram outside the most frequent.
    RareTokens,
    /// A caption shared by too many images.
    CaptionFrequency,
    /// An image with too many captions.
    ImageFrequency,
    /// The image does not decode (or re-encode).
    Undecodable,
    /// The same image bytes were kept already.
    DuplicateImage,
    /// A near-duplicate of an evaluation image (`--exclude-near`).
    NearDuplicateEval,
    /// A CLIP score under the threshold.
    ClipScore,
    /// A NaN, infinite or null score.
    UnusableScore,
    /// Scored with another caption under the same key.
    OtherCaption,
    /// Away from the image-based filter's target.
    ImageBased,
    /// Dropped by MetaCLIP's balancing.
    MetaclipBalance,
    /// A semantic duplicate (SemDeDup).
    SemanticDuplicate,
}

impl Filter {
    /// Every filter, in the order they are applied.
    pub const ALL: [Filter; 20] = [
        Filter::Unreadable,
        Filter::ImageFormat,
        Filter::ImageSize,
        Filter::AspectRatio,
        Filter::Boilerplate,
        Filter::WordCount,
        Filter::RepeatedWords,
        Filter::Capitalization,
        Filter::RareTokens,
        Filter::CaptionFrequency,
        Filter::ImageFrequency,
        Filter::Undecodable,
        Filter::DuplicateImage,
        Filter::NearDuplicateEval,
        Filter::ClipScore,
        Filter::UnusableScore,
        Filter::OtherCaption,
        Filter::ImageBased,
        Filter::MetaclipBalance,
        Filter::SemanticDuplicate,
    ];

    /// The name the report uses.
    pub fn name(self) -> &'static str {
        match self {
            Filter::Unreadable => "unreadable",
            Filter::ImageFormat => "image_format",
            Filter::ImageSize => "image_size",
            Filter::AspectRatio => "aspect_ratio",
            Filter::Boilerplate => "boilerplate",
            Filter::WordCount => "word_count",
            Filter::RepeatedWords => "repeated_words",
            Filter::Capitalization => "capitalization",
            Filter::RareTokens => "rare_tokens",
            Filter::CaptionFrequency => "caption_frequency",
            Filter::ImageFrequency => "image_frequency",
            Filter::Undecodable => "undecodable",
            Filter::DuplicateImage => "duplicate_image",
            Filter::NearDuplicateEval => "near_duplicate_eval",
            Filter::ClipScore => "clip_score",
            Filter::UnusableScore => "unusable_score",
            Filter::OtherCaption => "other_caption",
            Filter::ImageBased => "image_based",
            Filter::MetaclipBalance => "metaclip_balance",
            Filter::SemanticDuplicate => "semantic_duplicate",
        }
    }
}

/// Samples removed, counted by filter.
#[derive(Debug, Clone, Copy, Default)]
pub struct Removals([u64; Filter::ALL.len()]);

impl Removals {
    pub fn add(&mut self, f: Filter) {
        self.0[f as usize] += 1;
    }

    pub fn get(&self, f: Filter) -> u64 {
        self.0[f as usize]
    }

    /// Every filter with its count, in order.
    pub fn iter(&self) -> impl Iterator<Item = (Filter, u64)> + '_ {
        Filter::ALL.iter().map(|&f| (f, self.get(f)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ALL` lists each filter once, at its own index, so a count lands where the report reads it.
    #[test]
    fn every_filter_is_listed_once_in_order() {
        for (i, f) in Filter::ALL.iter().enumerate() {
            assert_eq!(*f as usize, i, "{f:?}");
        }
        let names: std::collections::HashSet<&str> = Filter::ALL.iter().map(|f| f.name()).collect();
        assert_eq!(names.len(), Filter::ALL.len());
        let mut r = Removals::default();
        r.add(Filter::ClipScore);
        r.add(Filter::ClipScore);
        assert_eq!(r.iter().filter(|(_, n)| *n > 0).collect::<Vec<_>>(), [(Filter::ClipScore, 2)]);
    }
}
