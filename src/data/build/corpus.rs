//! The first, decode-free pass of `align data build`, for the filters that need corpus
//! statistics: word and n-gram counts, how many images share a caption and how many captions an
//! image has, and MetaCLIP's matches per entry.

use std::collections::{HashMap, HashSet};

use xxhash_rust::xxh3::xxh3_128;

use super::curation::ScoreFit;
use super::filters::{self, Filters};
use super::input::{Input, Item};
use crate::data::curate::metaclip::Matcher;
use crate::data::curate::scores::ScoreTable;
use crate::util::progress::Progress;
use crate::util::rng::{hash_str, mix64};

/// Corpus statistics from the first pass.
#[derive(Default)]
pub(super) struct Counts {
    pub words: HashMap<String, u64>,
    /// The allowed unigrams and bigrams under `rare.top_ngrams`; None when every one is allowed.
    pub top_ngrams: Option<HashSet<String>>,
    pub caption_images: HashMap<u64, u32>,
    pub image_captions: HashMap<u128, u32>,
    /// Matches per MetaCLIP entry over the whole input, and input samples matching any.
    pub metaclip: Vec<u64>,
    pub metaclip_matched: u64,
}

pub(super) fn caption_key(caption: &str) -> u64 {
    hash_str(&caption.split_whitespace().collect::<Vec<_>>().join(" ").to_lowercase())
}

/// The counts, the items read, and (with `scores`) how the samples meet the score files.
pub(super) fn count_corpus(
    input: &Input,
    f: &Filters,
    matcher: Option<&Matcher>,
    scores: Option<&ScoreTable>,
    quiet: bool,
) -> (Counts, u64, ScoreFit) {
    let mut c = Counts::default();
    let mut fit = ScoreFit::default();
    if let Some(m) = matcher {
        c.metaclip = vec![0; m.entries.len()];
    }
    let mut ngrams: HashMap<String, u64> = HashMap::new();
    let mut pairs: HashSet<u128> = HashSet::new();
    let rare = &f.text.rare;
    let freq = f.frequency.max_images_per_caption > 0 || f.frequency.max_captions_per_image > 0;
    let bar = Progress::spinner("counting", quiet);
    let mut items = 0u64;
    for item in input.stream() {
        items += 1;
        bar.inc(1);
        let Item::Sample(s) = item else { continue };
        if let Some(t) = scores {
            fit.add(&t.lookup(&s.key, &s.caption), &s.key, &s.origin);
        }
        let caption = filters::trim_boilerplate(&s.caption, &f.text.trim_boilerplate);
        if let Some(m) = matcher {
            let matched = m.matches(&caption);
            c.metaclip_matched += u64::from(!matched.is_empty());
            for e in matched {
                c.metaclip[e as usize] += 1;
            }
        }
        let words = filters::norm_words(&caption);
        if rare.min_count > 0 {
            for w in &words {
                *c.words.entry(w.clone()).or_default() += 1;
            }
        }
        if rare.top_ngrams > 0 {
            for g in filters::ngrams(&words) {
                *ngrams.entry(g).or_default() += 1;
            }
        }
        if freq {
            let (ck, ik) = (caption_key(&caption), xxh3_128(&s.image));
            // Each distinct (caption, image) pair counts once on both sides.
            if pairs.insert(ik ^ (mix64(ck) as u128) << 64 ^ ck as u128) {
                *c.caption_images.entry(ck).or_default() += 1;
                *c.image_captions.entry(ik).or_default() += 1;
            }
        }
    }
    bar.finish();
    if rare.top_ngrams > 0 && ngrams.len() as u64 > rare.top_ngrams {
        let mut ranked: Vec<(String, u64)> = ngrams.into_iter().collect();
        ranked.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        ranked.truncate(rare.top_ngrams as usize);
        c.top_ngrams = Some(ranked.into_iter().map(|(g, _)| g).collect());
    }
    fit.samples = items;
    (c, items, fit)
}
