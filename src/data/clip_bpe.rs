//! CLIP's byte-level BPE tokenizer built as a `tokenizers` pipeline: from a checkpoint's
//! `vocab.json` and `merges.txt` (older Hugging Face repositories), or from the merges bundled
//! with align (`assets/clip-bpe-merges.txt.gz`, the 48,894 merges of CLIP's 49,408-token
//! vocabulary) for open_clip checkpoints, which ship no tokenizer files because open_clip's
//! `SimpleTokenizer` carries its own.
//!
//! open_clip's `SimpleTokenizer` cleans a text before splitting it: ftfy's repairs, HTML entities
//! unescaped, whitespace collapsed, lower-cased (`clean = "lower"`); `"whitespace"` keeps the
//! case and `"canonicalize"` also drops ASCII punctuation. The pipeline here does the same with
//! normalisers: the common HTML entities, curly quotes straightened (the ftfy repair web captions
//! need most), NFC, whitespace, case. ftfy's other repairs (mojibake, full-width characters) are
//! not reproduced. Ids are CLIP's; the special tokens are spelt `<|startoftext|>` and
//! `<|endoftext|>` as transformers spells them (open_clip spells them `<start_of_text>` and
//! `<end_of_text>`, with the same ids).

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

pub use super::text_clean::Clean;

static BUNDLED_MERGES: &[u8] = include_bytes!("../../assets/clip-bpe-merges.txt.gz");

/// The start and end tokens, as transformers names them.
pub const START: &str = "<|startoftext|>";
pub const END: &str = "<|endoftext|>";

/// GPT-2's byte-to-character table in CLIP's order: the printable bytes as themselves, then the
/// rest as characters from U+0100 on.
fn byte_symbols() -> Vec<char> {
    let mut bytes: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xa1..=0xac).chain(0xae..=0xff).collect();
    let mut chars: Vec<u32> = bytes.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bytes.contains(&b) {
            bytes.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    chars.into_iter().map(|c| char::from_u32(c).expect("a valid scalar")).collect()
}

/// The bundled merges, as pairs.
pub fn bundled_merges() -> Result<Vec<(String, String)>> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(BUNDLED_MERGES).read_to_string(&mut text).context("decompressing the bundled CLIP merges")?;
    parse_merges(&text, "the bundled CLIP merges")
}

fn parse_merges(text: &str, origin: &str) -> Result<Vec<(String, String)>> {
    text.lines()
        .enumerate()
        // The first line is a version header ("#version: 0.2", or open_clip's file name before it).
        .filter(|(i, l)| !(l.is_empty() || *i == 0 && l.contains("#version")))
        .map(|(_, l)| l)
        .map(|l| {
            l.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| anyhow!("{origin}: merge line {l:?} is not two symbols"))
        })
        .collect()
}

/// CLIP's vocabulary from its merges: the 256 byte symbols, the same with `</w>`, one entry per
/// merge, then the start and end tokens.
pub fn vocabulary(merges: &[(String, String)]) -> Vec<String> {
    let symbols: Vec<String> = byte_symbols().into_iter().map(String::from).collect();
    let mut vocab = symbols.clone();
    vocab.extend(symbols.iter().map(|s| format!("{s}</w>")));
    vocab.extend(merges.iter().map(|(a, b)| format!("{a}{b}")));
    vocab.push(START.into());
    vocab.push(END.into());
    vocab
}

/// The normalisers of a clean mode, as `tokenizer.json` spells them.
pub fn normalizers_json(clean: Clean) -> Vec<Value> {
    let replace = |from: &str, to: &str| json!({"type": "Replace", "pattern": {"String": from}, "content": to});
    // open_clip unescapes up to three times (ftfy, then html.unescape twice): "&amp;amp;amp;" is "&".
    let mut n = vec![replace("&amp;", "&"), replace("&amp;", "&"), replace("&amp;", "&")];
    for (from, to) in [("&lt;", "<"), ("&gt;", ">"), ("&quot;", "\""), ("&#39;", "'"), ("&#x27;", "'"), ("&apos;", "'"), ("&nbsp;", " ")] {
        n.push(replace(from, to));
    }
    for (from, to) in [("\u{2018}", "'"), ("\u{2019}", "'"), ("\u{201c}", "\""), ("\u{201d}", "\"")] {
        n.push(replace(from, to));
    }
    n.push(json!({"type": "NFC"}));
    if clean == Clean::Canonicalize {
        n.push(replace("_", " "));
        n.push(json!({"type": "Replace", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~]"}, "content": ""}));
    }
    n.push(json!({"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}));
    n.push(json!({"type": "Strip", "strip_left": true, "strip_right": true}));
    if clean != Clean::Whitespace {
        n.push(json!({"type": "Lowercase"}));
    }
    n
}

/// The normalisers of `clean` as the tokenizers library writes them back.
fn cleaning_wrapper(clean: Clean) -> Result<Value> {
    let ours: tokenizers::NormalizerWrapper = serde_json::from_value(json!({"type": "Sequence", "normalizers": normalizers_json(clean)}))
        .map_err(|e| anyhow!("building open_clip's text cleaning: {e}"))?;
    Ok(serde_json::to_value(ours)?)
}

/// Takes open_clip's cleaning out of a tokenizer's normaliser: the whole normaliser when it is
/// the cleaning (CLIP's `SimpleTokenizer`), or the first of two (a Hugging Face tokenizer that
/// open_clip cleans first). The caller cleans exactly instead.
pub fn take_cleaning(tok: &mut Tokenizer) -> Result<Option<Clean>> {
    let Some(n) = tok.get_normalizer() else { return Ok(None) };
    let found = serde_json::to_value(n)?;
    for clean in Clean::ALL {
        let ours = cleaning_wrapper(clean)?;
        if found == ours {
            tok.with_normalizer(None::<tokenizers::NormalizerWrapper>).map_err(|e| anyhow!("{e}"))?;
            return Ok(Some(clean));
        }
        if let Some([first, theirs]) = found.get("normalizers").and_then(Value::as_array).map(Vec::as_slice) {
            if *first == ours {
                let theirs: tokenizers::NormalizerWrapper = serde_json::from_value(theirs.clone())?;
                tok.with_normalizer(Some(theirs)).map_err(|e| anyhow!("{e}"))?;
                return Ok(Some(clean));
            }
        }
    }
    Ok(None)
}

/// Puts open_clip's cleaning, as normalisers, before a tokenizer's own normaliser.
pub fn put_cleaning(tok: &mut Tokenizer, clean: Clean) -> Result<()> {
    let ours: tokenizers::NormalizerWrapper = serde_json::from_value(cleaning_wrapper(clean)?)?;
    let combined = match tok.get_normalizer().cloned() {
        Some(theirs) => tokenizers::normalizers::Sequence::new(vec![ours, theirs]).into(),
        None => ours,
    };
    tok.with_normalizer(Some(combined)).map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// A CLIP tokenizer from a vocabulary (token → id) and merges, with the normalisers of `clean`
/// (`None`: transformers' CLIP normaliser, NFC, whitespace, lower case).
pub fn build(vocab: &HashMap<String, u32>, merges: &[(String, String)], clean: Option<Clean>) -> Result<Tokenizer> {
    let (start, end) = match (vocab.get(START), vocab.get(END)) {
        (Some(s), Some(e)) => (*s, *e),
        _ => bail!("the vocabulary has no {START} / {END}"),
    };
    let normalizer = match clean {
        Some(c) => json!({"type": "Sequence", "normalizers": normalizers_json(c)}),
        None => {
            json!({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}, {"type": "Lowercase"}]})
        }
    };
    let special = |id: u32, content: &str| json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(start, START), special(end, END)],
        "normalizer": normalizer,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "<\\|startoftext\\|>|<\\|endoftext\\|>|'s|'t|'re|'ve|'m|'ll|'d|[\\p{L}]+|[\\p{N}]|[^\\s\\p{L}\\p{N}]+"},
             "behavior": "Removed", "invert": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
        ]},
        "post_processor": {"type": "RobertaProcessing", "sep": [END, end], "cls": [START, start], "trim_offsets": false, "add_prefix_space": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": END, "continuing_subword_prefix": "", "end_of_word_suffix": "</w>",
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab,
                  "merges": merges.iter().map(|(a, b)| json!([a, b])).collect::<Vec<_>>()},
    });
    spec.to_string().parse::<Tokenizer>().map_err(|e| anyhow!("building the CLIP tokenizer: {e}"))
}

/// open_clip's `SimpleTokenizer`: CLIP's vocabulary from the bundled merges, cleaned as `clean`.
pub fn open_clip_simple(clean: Clean) -> Result<Tokenizer> {
    let merges = bundled_merges()?;
    let vocab: HashMap<String, u32> = vocabulary(&merges).into_iter().enumerate().map(|(i, t)| (t, i as u32)).collect();
    build(&vocab, &merges, Some(clean))
}

/// A CLIP tokenizer from a checkpoint's `vocab.json` and `merges.txt`.
pub fn from_files(vocab: &Path, merges: &Path) -> Result<Tokenizer> {
    let text = std::fs::read_to_string(vocab).with_context(|| format!("reading {}", vocab.display()))?;
    let v: HashMap<String, u32> = serde_json::from_str(&text).with_context(|| format!("{} is not a token → id map", vocab.display()))?;
    let m = std::fs::read_to_string(merges).with_context(|| format!("reading {}", merges.display()))?;
    build(&v, &parse_merges(&m, &merges.display().to_string())?, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundled_vocabulary_has_clips_ids() {
        let merges = bundled_merges().unwrap();
        assert_eq!(merges.len(), 48_894);
        let vocab = vocabulary(&merges);
        assert_eq!(vocab.len(), 49_408);
        // open_clip's table: '!' first, 'ÿ' at 187, byte 0 at 188 as U+0100, then '</w>' forms.
        assert_eq!((vocab[0].as_str(), vocab[187].as_str(), vocab[188].as_str(), vocab[256].as_str()), ("!", "ÿ", "Ā", "!</w>"));
        assert_eq!((vocab[49406].as_str(), vocab[49407].as_str(), vocab[49405].as_str()), (START, END, "jekyll</w>"));
    }

    /// Ids open_clip 3.3's SimpleTokenizer gives (scripts/make_open_clip_fixtures.py's notes):
    /// HTML entities, curly quotes, case and whitespace cleaned as it cleans them.
    #[test]
    fn open_clip_cleaning_gives_open_clips_ids() {
        let t = open_clip_simple(Clean::Lower).unwrap();
        let ids = t.encode("Two DOGS &amp; a Café: the dog\u{2019}s  \u{201c}ball\u{201d}!", true).unwrap().get_ids().to_vec();
        assert_eq!(ids, vec![49406, 1237, 3255, 261, 320, 15304, 281, 518, 1929, 568, 257, 1069, 10377, 49407]);
    }
}
