//! Learning a WordPiece vocabulary from captions, reproducibly.
//!
//! The method is the one Hugging Face's WordPiece trainer uses: words (after BERT's normaliser and
//! pre-tokeniser) are split into their first character and `##`-prefixed continuation characters,
//! and the most frequent adjacent pair is merged into one token again and again until the
//! vocabulary is full or no pair occurs `min_frequency` times. That trainer breaks ties between
//! equally frequent pairs by token ids it hands out in hash-map order, so the same captions give a
//! different vocabulary on every run. Here every tie is broken by the merged token itself (the
//! smallest string first), words are counted in a sorted map, and the ids are: the special
//! tokens, the alphabet in string order, then the merges in the order they were made. The same
//! captions give a byte-identical `tokenizer.json` on every run and any thread count.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};

/// Continuation pieces start with this, as BERT's do.
pub const PREFIX: &str = "##";

/// A candidate merge in the queue: most frequent first, then the smallest merged token. `count`
/// may be stale (it is checked against the live count when the candidate comes up).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Candidate {
    count: u64,
    merged: Reverse<String>,
    pair: (u32, u32),
}

/// The vocabulary learned from `words` (word → count): `specials`, then the alphabet, then the
/// merges, at most `vocab_size` tokens (never fewer than the specials and the alphabet).
pub fn learn(words: &BTreeMap<String, u64>, vocab_size: usize, min_frequency: u64, specials: &[&str]) -> Vec<String> {
    let mut vocab: Vec<String> = specials.iter().map(|s| s.to_string()).collect();
    let mut ids: HashMap<String, u32> = vocab.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    // The alphabet: every word's first character, and its other characters as continuations.
    let pieces = |w: &str| -> Vec<String> {
        w.chars().enumerate().map(|(i, c)| if i == 0 { c.to_string() } else { format!("{PREFIX}{c}") }).collect()
    };
    let alphabet: BTreeSet<String> = words.keys().flat_map(|w| pieces(w)).collect();
    for t in alphabet {
        if !ids.contains_key(&t) {
            ids.insert(t.clone(), vocab.len() as u32);
            vocab.push(t);
        }
    }
    let mut split: Vec<(Vec<u32>, u64)> = words.iter().map(|(w, &n)| (pieces(w).iter().map(|p| ids[p]).collect(), n)).collect();
    let mut pairs: HashMap<(u32, u32), u64> = HashMap::new();
    let mut holders: HashMap<(u32, u32), BTreeSet<usize>> = HashMap::new();
    for (wi, (sym, n)) in split.iter().enumerate() {
        for p in sym.windows(2) {
            *pairs.entry((p[0], p[1])).or_default() += n;
            holders.entry((p[0], p[1])).or_default().insert(wi);
        }
    }
    let merged_token = |vocab: &[String], (a, b): (u32, u32)| {
        let (a, b) = (&vocab[a as usize], &vocab[b as usize]);
        format!("{a}{}", b.strip_prefix(PREFIX).unwrap_or(b))
    };
    let mut queue: BinaryHeap<Candidate> =
        pairs.iter().map(|(&pair, &count)| Candidate { count, merged: Reverse(merged_token(&vocab, pair)), pair }).collect();
    while vocab.len() < vocab_size {
        let Some(top) = queue.pop() else { break };
        let live = pairs.get(&top.pair).copied().unwrap_or(0);
        if live != top.count {
            // Stale: the pair's count changed since it was queued.
            if live > 0 {
                queue.push(Candidate { count: live, ..top });
            }
            continue;
        }
        if live < min_frequency.max(1) {
            break;
        }
        let token = top.merged.0;
        let new = match ids.get(&token) {
            Some(&id) => id,
            None => {
                ids.insert(token.clone(), vocab.len() as u32);
                vocab.push(token);
                (vocab.len() - 1) as u32
            }
        };
        let words_with_pair: Vec<usize> = holders.remove(&top.pair).map(|s| s.into_iter().collect()).unwrap_or_default();
        let mut touched: BTreeSet<(u32, u32)> = BTreeSet::new();
        for wi in words_with_pair {
            let (sym, n) = &mut split[wi];
            let merged = merge_word(sym, top.pair, new);
            if merged == *sym {
                continue;
            }
            for p in sym.windows(2) {
                let c = pairs.entry((p[0], p[1])).or_default();
                *c -= *n;
                touched.insert((p[0], p[1]));
            }
            for p in merged.windows(2) {
                *pairs.entry((p[0], p[1])).or_default() += *n;
                holders.entry((p[0], p[1])).or_default().insert(wi);
                touched.insert((p[0], p[1]));
            }
            *sym = merged;
        }
        pairs.remove(&top.pair);
        for pair in touched {
            match pairs.get(&pair).copied() {
                Some(count) if count > 0 => queue.push(Candidate { count, merged: Reverse(merged_token(&vocab, pair)), pair }),
                _ => {
                    pairs.remove(&pair);
                }
            }
        }
    }
    vocab
}

/// `sym` with every non-overlapping occurrence of `pair`, left to right, replaced by `new`.
fn merge_word(sym: &[u32], pair: (u32, u32), new: u32) -> Vec<u32> {
    let mut out = Vec::with_capacity(sym.len());
    let mut i = 0;
    while i < sym.len() {
        if i + 1 < sym.len() && (sym[i], sym[i + 1]) == pair {
            out.push(new);
            i += 2;
        } else {
            out.push(sym[i]);
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_by_hand_with_ties_broken_by_the_token() {
        let words: BTreeMap<String, u64> =
            [("hug", 10), ("pug", 5), ("pun", 12), ("bun", 4), ("hugs", 5)].iter().map(|(w, n)| (w.to_string(), *n)).collect();
        // Pairs: (##u,##g) 20, (p,##u) 17, (##u,##n) 16, (h,##u) 15, (##g,##s) 5, (b,##u) 4.
        // After ##ug: (##u,##n) 16, (h,##ug) 15, (p,##u) 12, (p,##ug) 5, (##ug,##s) 5; after
        // ##un and hug: (p,##un) 12, then (hug,##s) 5 and (p,##ug) 5, a tie the merged token
        // breaks ("hugs" < "pug"), then (b,##un) 4.
        let vocab = learn(&words, 100, 1, &["[UNK]"]);
        let want = ["[UNK]", "##g", "##n", "##s", "##u", "b", "h", "p", "##ug", "##un", "hug", "pun", "hugs", "pug", "bun"];
        assert_eq!(vocab, want);
        // The size limit counts every token; min_frequency stops at rarer pairs.
        assert_eq!(learn(&words, 10, 1, &["[UNK]"]), want[..10]);
        assert_eq!(learn(&words, 100, 13, &["[UNK]"]), want[..11]);
    }

    #[test]
    fn overlapping_pairs_merge_left_to_right() {
        assert_eq!(merge_word(&[1, 1, 1, 2], (1, 1), 9), vec![9, 1, 2]);
        let words: BTreeMap<String, u64> = [("aaa".to_string(), 3)].into_iter().collect();
        // (a,##a) 3 and (##a,##a) 3 tie: "##a##a" becomes "##aa", "a"+"##a" becomes "aa"; "##aa"
        // sorts first.
        assert_eq!(learn(&words, 100, 1, &[]), ["##a", "a", "##aa", "aaa"]);
    }
}
