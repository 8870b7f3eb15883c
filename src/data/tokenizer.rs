//! WordPiece (BERT) tokenisation with `[CLS] … [SEP]`, truncation and padding to a fixed length,
//! and training a vocabulary on the captions themselves as ALIGN does.
//!
//! The vocabulary is a `tokenizer.json` in Hugging Face's format, so `transformers` and
//! `tokenizers` load ours and we load theirs (e.g. `bert-base-uncased`'s).

use std::path::Path;

use super::text_clean::Clean;
use anyhow::{anyhow, bail, Context, Result};
use tokenizers::models::wordpiece::WordPiece;
use tokenizers::normalizers::bert::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

pub const PAD: &str = "[PAD]";
pub const UNK: &str = "[UNK]";
pub const CLS: &str = "[CLS]";
pub const SEP: &str = "[SEP]";
pub const MASK: &str = "[MASK]";
/// CLIP's end-of-text token, which its tokenizers also pad with.
pub const CLIP_END: &str = "<|endoftext|>";
/// The end of a SentencePiece text (SigLIP, T5), which SigLIP also pads with.
pub const SENTENCE_END: &str = "</s>";
/// CC12M replaces person names by this hypernym; it must never be split into `<`, `person`, `>`.
pub const PERSON: &str = "<PERSON>";

/// Token ids and attention masks of a batch, each `batch × max_len`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenBatch {
    pub ids: Vec<u32>,
    pub mask: Vec<u32>,
    pub max_len: usize,
}

#[derive(Clone)]
pub struct TextTokenizer {
    /// Without open_clip's cleaning, which `clean` does before it.
    inner: Tokenizer,
    max_len: usize,
    pad_id: u32,
    /// open_clip's text cleaning, run on each text before the tokenizer's own normaliser. A
    /// `tokenizer.json` carries it as the normalisers that `clip_bpe::normalizers_json` spells,
    /// an approximation other libraries run; align recognises them and cleans exactly.
    clean: Option<Clean>,
    /// Padding goes before the text (transformers' `padding_side = "left"`: Gemma's and SigLIP
    /// 2's tokenizers), so the last position holds the end of the text.
    pad_left: bool,
}

/// A `tokenizer.json`, read without a panic whatever the file holds: a damaged file is an error
/// naming it (the `tokenizers` crate panics on some malformed vocabularies instead of failing).
pub fn read_tokenizer_json(path: &Path) -> Result<Tokenizer> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading tokenizer {}", path.display()))?;
    // Malformed JSON fails here, cleanly; the tokenizers crate panics on some of it.
    serde_json::from_str::<serde_json::Value>(&text).with_context(|| format!("tokenizer {} is damaged: not JSON", path.display()))?;
    let parsed = std::panic::catch_unwind(|| text.parse::<Tokenizer>());
    match parsed {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => bail!("tokenizer {} is damaged or not a tokenizer.json: {e}", path.display()),
        Err(_) => bail!("tokenizer {} is damaged: the tokenizers library could not read it", path.display()),
    }
}

impl TextTokenizer {
    pub fn from_file(path: &Path, max_len: usize) -> Result<Self> {
        let inner = read_tokenizer_json(path)?;
        Self::new(inner, max_len).with_context(|| format!("tokenizer {}", path.display()))
    }

    /// A BERT vocabulary (it has `[PAD]`), or a CLIP or SigLIP one padded with its end token.
    pub fn new(mut inner: Tokenizer, max_len: usize) -> Result<Self> {
        if max_len < 2 {
            bail!("max_len {max_len} leaves no room for [CLS] and [SEP]");
        }
        // A padding token the file records (align saves its own) is the one to pad with.
        if let Some(pad) = inner.get_padding().map(|p| p.pad_token.clone()) {
            if inner.token_to_id(&pad).is_some() && inner.get_post_processor().is_some() {
                return Self::with_pad_token(inner, max_len, &pad);
            }
        }
        if inner.token_to_id(PAD).is_none() {
            if let Some(end) = [CLIP_END, SENTENCE_END].into_iter().find(|t| inner.token_to_id(t).is_some()) {
                return Self::with_pad_token(inner, max_len, end);
            }
        }
        for t in [PAD, CLS, SEP] {
            inner.token_to_id(t).ok_or_else(|| anyhow!("vocabulary has no {t} token"))?;
        }
        if inner.get_post_processor().is_none() {
            // A vocabulary without a post-processor would silently drop [CLS]/[SEP] and break
            // [CLS] pooling; attach BERT's template.
            attach_bert_template(&mut inner)?;
        }
        Self::with_pad_token(inner, max_len, PAD)
    }

    /// Any `tokenizer.json` whose own post-processor adds the special tokens (CLIP's
    /// `<|startoftext|> … <|endoftext|>`), padded with `pad_token`.
    pub fn with_pad_token(mut inner: Tokenizer, max_len: usize, pad_token: &str) -> Result<Self> {
        let pad_id = inner.token_to_id(pad_token).ok_or_else(|| anyhow!("vocabulary has no padding token {pad_token:?}"))?;
        let pad_left = inner.get_padding().is_some_and(|p| matches!(p.direction, tokenizers::PaddingDirection::Left));
        if inner.get_post_processor().is_none() {
            bail!("the tokenizer adds no special tokens (it has no post-processor)");
        }
        inner
            .with_truncation(Some(TruncationParams {
                max_length: max_len,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
                direction: TruncationDirection::Right,
            }))
            .map_err(|e| anyhow!("{e}"))?;
        inner.with_padding(None);
        let clean = super::clip_bpe::take_cleaning(&mut inner)?;
        Ok(Self { inner, max_len, pad_id, clean, pad_left })
    }

    /// A BERT tokenizer from a WordPiece `vocab.txt` (checkpoints that ship no `tokenizer.json`).
    pub fn from_bert_vocab(vocab: &Path, lowercase: bool, max_len: usize) -> Result<Self> {
        let vocab_s = vocab.to_str().ok_or_else(|| anyhow!("{} is not valid UTF-8", vocab.display()))?;
        let model = WordPiece::from_file(vocab_s).unk_token(UNK.into()).build().map_err(|e| anyhow!("reading {}: {e}", vocab.display()))?;
        let mut tok = Tokenizer::new(model);
        tok.with_normalizer(Some(BertNormalizer::new(true, true, Some(lowercase), lowercase))).map_err(|e| anyhow!("{e}"))?;
        tok.with_pre_tokenizer(Some(BertPreTokenizer));
        Self::new(tok, max_len).with_context(|| format!("tokenizer from {}", vocab.display()))
    }

    pub fn max_len(&self) -> usize {
        self.max_len
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The tokenizer without open_clip's cleaning (see `clean`).
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// The same tokenizer lower-casing each text before its own normaliser (SigLIP 2's
    /// processor does).
    pub fn lowercased(mut self) -> Result<Self> {
        let lower: tokenizers::NormalizerWrapper = tokenizers::normalizers::utils::Lowercase.into();
        let n = match self.inner.get_normalizer().cloned() {
            Some(theirs) => tokenizers::normalizers::Sequence::new(vec![lower, theirs]).into(),
            None => lower,
        };
        self.inner.with_normalizer(Some(n)).map_err(|e| anyhow!("{e}"))?;
        Ok(self)
    }

    /// The same tokenizer padding before the text instead of after it.
    pub fn padding_left(mut self, left: bool) -> Self {
        self.pad_left = left;
        self
    }

    pub fn pads_left(&self) -> bool {
        self.pad_left
    }

    /// open_clip's text cleaning, when the tokenizer's texts are cleaned as open_clip cleans them.
    pub fn clean(&self) -> Option<Clean> {
        self.clean
    }

    /// The tokenizer as another library runs it: open_clip's cleaning, if any, put back as the
    /// normalisers that approximate it.
    pub fn portable(&self) -> Result<Tokenizer> {
        let mut t = self.inner.clone();
        if let Some(c) = self.clean {
            super::clip_bpe::put_cleaning(&mut t, c)?;
        }
        Ok(t)
    }

    fn cleaned<'a>(&self, text: &'a str) -> std::borrow::Cow<'a, str> {
        match self.clean {
            Some(c) => std::borrow::Cow::Owned(c.apply(text)),
            None => std::borrow::Cow::Borrowed(text),
        }
    }

    /// Writes the tokenizer as a `tokenizer.json` that records its padding token, so that it
    /// reads back padding the same way (open_clip pads CLIP's ids with 0, transformers with
    /// `<|endoftext|>`; a text tower that attends to its padding tells them apart).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut t = self.portable()?;
        let pad_token = t.id_to_token(self.pad_id).ok_or_else(|| anyhow!("the padding id {} has no token", self.pad_id))?;
        t.with_padding(Some(tokenizers::PaddingParams {
            strategy: tokenizers::PaddingStrategy::Fixed(self.max_len),
            direction: if self.pad_left { tokenizers::PaddingDirection::Left } else { tokenizers::PaddingDirection::Right },
            pad_id: self.pad_id,
            pad_token,
            ..Default::default()
        }));
        t.save(path, true).map_err(|e| anyhow!("saving tokenizer {}: {e}", path.display()))
    }

    /// The id texts are padded with.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// Tokenises one text into `ids`/`mask` rows of length `max_len` (appended to the vectors).
    pub fn encode_into(&self, text: &str, ids: &mut Vec<u32>, mask: &mut Vec<u32>) -> Result<()> {
        let enc = self.inner.encode(self.cleaned(text).as_ref(), true).map_err(|e| anyhow!("tokenising {text:?}: {e}"))?;
        let n = enc.get_ids().len().min(self.max_len);
        let pads = self.max_len - n;
        if self.pad_left {
            ids.extend(std::iter::repeat_n(self.pad_id, pads));
            mask.extend(std::iter::repeat_n(0, pads));
        }
        ids.extend_from_slice(&enc.get_ids()[..n]);
        mask.extend(std::iter::repeat_n(1, n));
        if !self.pad_left {
            ids.extend(std::iter::repeat_n(self.pad_id, pads));
            mask.extend(std::iter::repeat_n(0, pads));
        }
        Ok(())
    }

    pub fn encode_batch<S: AsRef<str>>(&self, texts: &[S]) -> Result<TokenBatch> {
        let mut ids = Vec::with_capacity(texts.len() * self.max_len);
        let mut mask = Vec::with_capacity(texts.len() * self.max_len);
        for t in texts {
            self.encode_into(t.as_ref(), &mut ids, &mut mask)?;
        }
        Ok(TokenBatch { ids, mask, max_len: self.max_len })
    }

    pub fn tokens(&self, text: &str) -> Result<Vec<String>> {
        let enc = self.inner.encode(self.cleaned(text).as_ref(), true).map_err(|e| anyhow!("tokenising {text:?}: {e}"))?;
        Ok(enc.get_tokens().to_vec())
    }
}

fn attach_bert_template(tok: &mut Tokenizer) -> Result<()> {
    let cls = tok.token_to_id(CLS).ok_or_else(|| anyhow!("no {CLS}"))?;
    let sep = tok.token_to_id(SEP).ok_or_else(|| anyhow!("no {SEP}"))?;
    let template = TemplateProcessing::builder()
        .try_single(format!("{CLS}:0 $A:0 {SEP}:0"))
        .map_err(|e| anyhow!("{e}"))?
        .try_pair(format!("{CLS}:0 $A:0 {SEP}:0 $B:1 {SEP}:1"))
        .map_err(|e| anyhow!("{e}"))?
        .special_tokens(vec![(CLS, cls), (SEP, sep)])
        .build()
        .map_err(|e| anyhow!("{e}"))?;
    tok.with_post_processor(Some(template));
    Ok(())
}

/// Trains a BERT-style WordPiece vocabulary of (at most) `vocab_size` entries on `captions`
/// (`data::wordpiece`): the same captions give the same vocabulary, byte for byte, on every run
/// and any thread count.
///
/// The special tokens come first (`[PAD]`=0, `[UNK]`, `[CLS]`, `[SEP]`, `[MASK]`, `<PERSON>`).
pub fn train_wordpiece<I, S>(captions: I, vocab_size: usize, lowercase: bool, min_frequency: u64) -> Result<Tokenizer>
where
    I: Iterator<Item = S> + Send,
    S: AsRef<str> + Send,
{
    let specials = [PAD, UNK, CLS, SEP, MASK, PERSON];
    let normalizer = BertNormalizer::new(true, true, Some(lowercase), lowercase);
    let words = count_words(captions, &normalizer)?;
    let vocab = super::wordpiece::learn(&words, vocab_size, min_frequency, &specials);
    let ids: ahash::AHashMap<String, u32> = vocab.into_iter().enumerate().map(|(i, t)| (t, i as u32)).collect();
    let model = WordPiece::builder()
        .vocab(ids)
        .unk_token(UNK.into())
        .continuing_subword_prefix(super::wordpiece::PREFIX.into())
        .build()
        .map_err(|e| anyhow!("{e}"))?;
    let mut tok = Tokenizer::new(model);
    tok.with_normalizer(Some(normalizer)).map_err(|e| anyhow!("{e}"))?;
    tok.with_pre_tokenizer(Some(BertPreTokenizer));
    tok.add_special_tokens(specials.iter().map(|t| AddedToken::from(*t, true)).collect::<Vec<_>>()).map_err(|e| anyhow!("{e}"))?;
    attach_bert_template(&mut tok)?;
    Ok(tok)
}

/// How often each word occurs in `captions`, after BERT's normaliser and pre-tokeniser (the
/// `<PERSON>` token is one token of its own, never part of a word).
fn count_words<I, S>(captions: I, normalizer: &BertNormalizer) -> Result<std::collections::BTreeMap<String, u64>>
where
    I: Iterator<Item = S> + Send,
    S: AsRef<str> + Send,
{
    use rayon::prelude::*;
    use tokenizers::{NormalizedString, Normalizer, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    let captions: Vec<String> = captions.map(|c| c.as_ref().replace(PERSON, " ")).collect();
    let counts = captions
        .par_iter()
        .try_fold(std::collections::HashMap::<String, u64>::new, |mut counts, c| -> Result<_> {
            let mut n = NormalizedString::from(c.as_str());
            normalizer.normalize(&mut n).map_err(|e| anyhow!("normalising {c:?}: {e}"))?;
            let mut pre = PreTokenizedString::from(n);
            BertPreTokenizer.pre_tokenize(&mut pre).map_err(|e| anyhow!("splitting {c:?}: {e}"))?;
            for (word, _, _) in pre.get_splits(OffsetReferential::Original, OffsetType::Byte) {
                *counts.entry(word.to_string()).or_default() += 1;
            }
            Ok(counts)
        })
        .collect::<Result<Vec<_>>>()?;
    let mut all = std::collections::BTreeMap::new();
    for part in counts {
        for (w, n) in part {
            *all.entry(w).or_default() += n;
        }
    }
    Ok(all)
}

/// Reads up to `limit` captions (0 = all) from shards, in order, for vocabulary training.
pub fn captions_from_shards(shards: &[crate::data::spec::ShardSource], limit: usize) -> Vec<String> {
    let mut out = Vec::new();
    for src in shards {
        crate::data::tar_read::read_shard(src, |ev| {
            if let crate::data::tar_read::ShardEvent::Sample(s) = ev {
                if let Ok(caps) = crate::data::sample::captions(&s) {
                    out.extend(caps);
                }
            }
            limit == 0 || out.len() < limit
        });
        if limit > 0 && out.len() >= limit {
            out.truncate(limit);
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same captions, trained on again and on 1 and 3 threads, give one `tokenizer.json`,
    /// byte for byte; a caption more changes it.
    #[test]
    fn vocabularies_are_byte_identical_across_runs_and_thread_counts() {
        let captions: Vec<String> = (0..400)
            .map(|i| {
                format!("a {} photo of the {} <PERSON> near {} {}", ["red", "blue", "big"][i % 3], i % 17, i % 5, ["dogs", "cats"][i % 2])
            })
            .collect();
        let json = |threads: usize, caps: &[String]| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let tok = pool.install(|| train_wordpiece(caps.iter(), 120, true, 2).unwrap());
            tok.to_string(false).unwrap()
        };
        let first = json(1, &captions);
        assert_eq!(first, json(3, &captions));
        assert_eq!(first, json(3, &captions));
        let mut more = captions.clone();
        more.push("an unusual zebra".into());
        assert_ne!(first, json(1, &more));
        // <PERSON> stays one token, the specials lead the vocabulary.
        let tok = TextTokenizer::new(std::str::FromStr::from_str(&first).unwrap(), 16).unwrap();
        assert_eq!(tok.tokens("<PERSON> dogs").unwrap()[1], PERSON);
        assert_eq!(tok.inner().token_to_id(PAD), Some(0));
    }

    fn small_tokenizer(max_len: usize) -> TextTokenizer {
        let captions = [
            "a small red circle on a grey background",
            "a big blue square",
            "grey backdrop with a red disc",
            "photo of <PERSON> holding a blue cup",
        ];
        let tok = train_wordpiece(captions.iter().cycle().take(40), 200, true, 1).unwrap();
        TextTokenizer::new(tok, max_len).unwrap()
    }

    /// transformers' `padding_side = "left"`: the padding before the text, kept by a save.
    #[test]
    fn left_padding_puts_the_text_last_and_survives_a_save() {
        let t = small_tokenizer(8).padding_left(true);
        let b = t.encode_batch(&["a dog"]).unwrap();
        let n = b.mask.iter().filter(|&&m| m == 1).count();
        assert!(n < 8 && b.mask[..8 - n].iter().all(|&m| m == 0) && b.mask[8 - n..].iter().all(|&m| m == 1), "{b:?}");
        assert!(b.ids[..8 - n].iter().all(|&i| i == t.pad_id()));
        let dir = tempfile::tempdir().unwrap();
        t.save(&dir.path().join("tokenizer.json")).unwrap();
        let back = TextTokenizer::from_file(&dir.path().join("tokenizer.json"), 8).unwrap();
        assert!(back.pads_left());
        assert_eq!(back.encode_batch(&["a dog"]).unwrap(), b);
    }

    #[test]
    fn captions_get_cls_and_sep_and_padding_with_a_mask() {
        let tok = small_tokenizer(10);
        let b = tok.encode_batch(&["A red circle", ""]).unwrap();
        let (cls, sep, pad) =
            (tok.inner.token_to_id(CLS).unwrap(), tok.inner.token_to_id(SEP).unwrap(), tok.inner.token_to_id(PAD).unwrap());
        assert_eq!(b.ids.len(), 20);
        assert_eq!(b.ids[0], cls);
        assert_eq!(b.ids[4], sep);
        assert_eq!(&b.ids[5..10], &[pad; 5]);
        assert_eq!(&b.mask[..10], &[1, 1, 1, 1, 1, 0, 0, 0, 0, 0]);
        // The empty caption is just [CLS] [SEP].
        assert_eq!(&b.ids[10..12], &[cls, sep]);
        assert_eq!(b.mask[10..].iter().sum::<u32>(), 2);
    }

    #[test]
    fn long_captions_are_truncated_keeping_sep() {
        let tok = small_tokenizer(6);
        let b = tok.encode_batch(&["a small red circle on a grey background"]).unwrap();
        let sep = tok.inner.token_to_id(SEP).unwrap();
        assert_eq!(b.ids.len(), 6);
        assert_eq!(b.ids[5], sep);
        assert!(b.mask.iter().all(|&m| m == 1));
    }

    #[test]
    fn lowercasing_and_the_person_token() {
        let tok = small_tokenizer(16);
        assert_eq!(tok.tokens("RED Circle").unwrap(), vec!["[CLS]", "red", "circle", "[SEP]"]);
        let toks = tok.tokens("<PERSON> holding a cup").unwrap();
        assert_eq!(toks[1], PERSON, "{toks:?}");
    }

    #[test]
    fn a_saved_vocabulary_loads_back_identically() {
        let tok = small_tokenizer(12);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        tok.save(&path).unwrap();
        let back = TextTokenizer::from_file(&path, 12).unwrap();
        let text = ["grey backdrop with a blue disc"];
        assert_eq!(tok.encode_batch(&text).unwrap(), back.encode_batch(&text).unwrap());
    }
}
