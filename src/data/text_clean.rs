//! open_clip's text cleaning, which its tokenizers run on every caption and prompt before BPE:
//! ftfy's `fix_text` with its default settings, `html.unescape` twice more, whitespace folded,
//! then lower-casing (`"lower"`, the default of CLIP's own tokenizer), nothing more
//! (`"whitespace"`, the default of a Hugging Face tokenizer) or SigLIP's canonicalisation.
//!
//! ftfy's repairs are reproduced as its defaults apply them to text that is not mojibake: HTML
//! entities unescaped until none is left (only on lines without a `<`), C1 controls read as
//! Windows-1252, Latin ligatures split, full-width and half-width forms to their plain width,
//! curly quotes straightened, line breaks unified, terminal escapes and stray control characters
//! removed, NFC. Of its mojibake repairs, UTF-8 read as Windows-1252 is undone where the bytes
//! spell UTF-8 (`cafÃ©` is `café`, `â€™` is `’`), with a narrower test than ftfy's weighing of
//! how unlikely the text is: a lone two-byte sequence is undone only after `Â` or `Ã` (so
//! `«CAFÉ»` keeps its `É»`). Other code pages' mojibake is left as it is.

use std::borrow::Cow;

use anyhow::{bail, Result};
use unicode_normalization::UnicodeNormalization;

/// How open_clip cleans a text before tokenising it (`tokenizer_kwargs.clean`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clean {
    /// Whitespace collapsed and lower-cased (open_clip's default).
    Lower,
    /// Whitespace collapsed, case kept.
    Whitespace,
    /// Underscores to spaces, ASCII punctuation removed, lower-cased, whitespace collapsed
    /// (SigLIP's canonicalisation).
    Canonicalize,
}

impl Clean {
    pub const ALL: [Clean; 3] = [Clean::Lower, Clean::Whitespace, Clean::Canonicalize];

    pub fn parse(name: &str) -> Result<Clean> {
        match name {
            "lower" => Ok(Clean::Lower),
            "whitespace" => Ok(Clean::Whitespace),
            "canonicalize" => Ok(Clean::Canonicalize),
            other => bail!("tokenizer clean mode {other:?} is not one of lower, whitespace, canonicalize"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Clean::Lower => "lower",
            Clean::Whitespace => "whitespace",
            Clean::Canonicalize => "canonicalize",
        }
    }

    /// The text as open_clip's tokenizer sees it after cleaning.
    pub fn apply(self, text: &str) -> String {
        let basic = basic_clean(text);
        match self {
            Clean::Lower => fold_whitespace(&basic).to_lowercase(),
            Clean::Whitespace => fold_whitespace(&basic),
            Clean::Canonicalize => {
                let kept: String = basic.replace('_', " ").chars().filter(|c| !c.is_ascii_punctuation()).collect();
                fold_whitespace(&kept.to_lowercase())
            }
        }
    }
}

/// ftfy's `fix_text`, then `html.unescape` twice, then surrounding whitespace stripped.
fn basic_clean(text: &str) -> String {
    let fixed = fix_text(text);
    let once = html_unescape(&fixed);
    let twice = html_unescape(&once);
    twice.trim_matches(is_python_space).to_string()
}

/// Python's `str.isspace`: Unicode's White_Space and the four information separators.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `re.sub(r"\s+", " ", text).strip()`.
fn fold_whitespace(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for word in text.split(is_python_space).filter(|w| !w.is_empty()) {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(word);
    }
    out
}

/// ftfy's `fix_text` with its defaults, line by line (each line keeps its break), each line
/// fixed until it no longer changes, as ftfy does.
pub fn fix_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        // ftfy's "auto" HTML handling: a line with a tag in it is HTML, whose entities are left.
        let unescape = !line.contains('<');
        let mut current = line.to_string();
        loop {
            let next = fix_once(&current, unescape);
            if next == current {
                break;
            }
            current = next;
        }
        out.push_str(&current);
    }
    out
}

fn fix_once(text: &str, unescape: bool) -> String {
    let text: Cow<str> = if unescape { Cow::Owned(ftfy_unescape(text)) } else { Cow::Borrowed(text) };
    let text = undo_utf8_as_cp1252(&text);
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        // Terminal colour escapes: ESC [ digits-and-semicolons letter.
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            let rest: String = chars.clone().skip(1).take_while(|d| d.is_ascii_digit() || *d == ';').collect();
            let after = chars.clone().nth(1 + rest.chars().count());
            if after.is_some_and(|l| l.is_ascii_alphabetic()) {
                for _ in 0..rest.chars().count() + 2 {
                    chars.next();
                }
                continue;
            }
        }
        let c = c1_control(c);
        if let Some(s) = ligature(c) {
            out.push_str(s);
            continue;
        }
        if c == '\u{3000}' {
            out.push(' ');
            continue;
        }
        if ('\u{ff01}'..'\u{fff0}').contains(&c) {
            out.extend(std::iter::once(c).nfkc());
            continue;
        }
        match c {
            '\u{2bc}' | '\u{2018}'..='\u{201b}' => out.push('\''),
            '\u{201c}'..='\u{201f}' => out.push('"'),
            '\r' if chars.peek() == Some(&'\n') => {}
            '\r' | '\u{2028}' | '\u{2029}' | '\u{85}' => out.push('\n'),
            c if is_removed_control(c) => {}
            c => out.push(c),
        }
    }
    out.nfc().collect()
}

/// The byte a character stands for when UTF-8 was misread as Windows-1252 (the five bytes that
/// code page leaves undefined read as the C1 controls of the same number).
fn cp1252_byte(c: char) -> Option<u8> {
    match c {
        '\u{a0}'..='\u{ff}' | '\u{81}' | '\u{8d}' | '\u{8f}' | '\u{90}' | '\u{9d}' => Some(c as u32 as u8),
        c => (0x80u8..0xa0).find(|&b| c1_control(char::from(b)) == c && c != char::from(b)),
    }
}

/// Runs of characters whose Windows-1252 bytes are whole UTF-8 sequences of non-ASCII
/// characters, decoded (ftfy's repair of UTF-8 embedded in other text).
fn undo_utf8_as_cp1252(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        let (run, bytes) = utf8_run(&chars[i..]);
        let decoded = if run > 0 { std::str::from_utf8(&bytes).ok() } else { None };
        let plausible = decoded.is_some_and(|d| {
            let lone_pair = d.chars().count() == 1 && bytes.len() == 2;
            !lone_pair || matches!(chars[i], 'Â' | 'Ã')
        });
        match decoded.filter(|_| plausible) {
            Some(d) => {
                out.push_str(d);
                i += run;
            }
            None => {
                out.push(chars[i]);
                i += 1;
            }
        }
    }
    out
}

/// How many characters from the start spell whole multi-byte UTF-8 sequences in Windows-1252,
/// and their bytes.
fn utf8_run(chars: &[char]) -> (usize, Vec<u8>) {
    let mut bytes = Vec::new();
    let mut at = 0;
    while let Some(lead) = chars.get(at).and_then(|&c| cp1252_byte(c)) {
        let need = match lead {
            0xc2..=0xdf => 1,
            0xe0..=0xef => 2,
            0xf0..=0xf4 => 3,
            _ => break,
        };
        let tail: Option<Vec<u8>> =
            (1..=need).map(|k| chars.get(at + k).and_then(|&c| cp1252_byte(c)).filter(|b| (0x80..0xc0).contains(b))).collect();
        let Some(tail) = tail else { break };
        bytes.push(lead);
        bytes.extend(tail);
        at += need + 1;
    }
    (at, bytes)
}

/// A C1 control character read as the Windows-1252 byte it stands for (ftfy's `fix_c1_controls`;
/// the five bytes Windows-1252 leaves undefined stay as they are).
fn c1_control(c: char) -> char {
    const CP1252: [char; 32] = [
        '€', '\u{81}', '‚', 'ƒ', '„', '…', '†', '‡', 'ˆ', '‰', 'Š', '‹', 'Œ', '\u{8d}', 'Ž', '\u{8f}', '\u{90}', '‘', '’', '“', '”', '•',
        '–', '—', '˜', '™', 'š', '›', 'œ', '\u{9d}', 'ž', 'Ÿ',
    ];
    match c {
        '\u{80}'..='\u{9f}' => CP1252[c as usize - 0x80],
        c => c,
    }
}

/// ftfy's Latin ligatures and legacy digraphs, split.
fn ligature(c: char) -> Option<&'static str> {
    Some(match c {
        'Ĳ' => "IJ",
        'ĳ' => "ij",
        'ŉ' => "ʼn",
        'Ǳ' => "DZ",
        'ǲ' => "Dz",
        'ǳ' => "dz",
        'Ǆ' => "DŽ",
        'ǅ' => "Dž",
        'ǆ' => "dž",
        'Ǉ' => "LJ",
        'ǈ' => "Lj",
        'ǉ' => "lj",
        'Ǌ' => "NJ",
        'ǋ' => "Nj",
        'ǌ' => "nj",
        'ﬀ' => "ff",
        'ﬁ' => "fi",
        'ﬂ' => "fl",
        'ﬃ' => "ffi",
        'ﬄ' => "ffl",
        'ﬅ' => "ſt",
        'ﬆ' => "st",
        _ => return None,
    })
}

/// The control characters ftfy removes: C0 controls other than tab, line feed, form feed and
/// carriage return, DEL, the deprecated format characters, the byte-order mark and the
/// interlinear annotation characters.
fn is_removed_control(c: char) -> bool {
    matches!(c, '\0'..='\u{8}' | '\u{b}' | '\u{e}'..='\u{1f}' | '\u{7f}' | '\u{206a}'..='\u{206f}' | '\u{feff}' | '\u{fff9}'..='\u{fffc}')
}

/// ftfy's own entity pass: `&name;` or `&#number;` (at most 24 letters and digits), replaced
/// when it is a whole HTML5 entity; an all-capitals name of a lower-case entity (`&EACUTE;`) is
/// its character in capitals.
fn ftfy_unescape(text: &str) -> String {
    replace_refs(text, |s: &str| {
        let body = s.strip_prefix('&')?.strip_suffix(';')?;
        let name = body.strip_prefix('#').unwrap_or(body);
        if name.is_empty() || name.len() > 24 || !name.chars().all(|c| c.is_ascii_alphanumeric()) {
            return None;
        }
        if body.starts_with('#') {
            let u = html_unescape(s);
            return (!u.contains(';')).then_some(u);
        }
        if let Some(u) = named_exact(s) {
            return Some(u);
        }
        let lower = body.to_ascii_lowercase();
        if body == body.to_ascii_uppercase() && lower != body {
            return named_exact(&format!("&{lower};")).map(|u| u.to_uppercase());
        }
        None
    })
}

/// The character of a whole named reference with its semicolon, if it is one.
fn named_exact(s: &str) -> Option<String> {
    let u = htmlize::unescape(s);
    // A whole entity leaves nothing of its name behind.
    (u != s && !u.contains(';')).then(|| u.into_owned())
}

/// Each `&` followed by up to 25 entity characters offered to `f` as `&…;` candidates, the
/// longest ending in `;` first; the first it accepts is replaced.
fn replace_refs(text: &str, f: impl Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('&') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        let end = tail[1..].find(';').map(|i| i + 2).filter(|&e| e <= 27);
        match end.and_then(|e| f(&tail[..e]).map(|u| (e, u))) {
            Some((e, u)) => {
                out.push_str(&u);
                rest = &tail[e..];
            }
            None => {
                out.push('&');
                rest = &tail[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Python's `html.unescape`: numeric references (with Python's table for the invalid ones) and
/// named ones, the longest HTML5 name that matches, with or without its semicolon.
pub fn html_unescape(text: &str) -> String {
    if !text.contains('&') {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('&') {
        out.push_str(&rest[..at]);
        let tail = &rest[at + 1..];
        let consumed = if let Some(num) = tail.strip_prefix('#') {
            numeric_ref(num).map(|(len, s)| {
                out.push_str(&s);
                len + 1
            })
        } else {
            named_ref(tail).map(|(len, s)| {
                out.push_str(&s);
                len
            })
        };
        match consumed {
            Some(len) => rest = &tail[len..],
            None => {
                out.push('&');
                rest = tail;
            }
        }
    }
    out.push_str(rest);
    out
}

/// `#123;`, `#x1F600` and the like (after the `#`): the bytes consumed and the text.
fn numeric_ref(s: &str) -> Option<(usize, String)> {
    let (hex, digits_at) = match s.as_bytes().first() {
        Some(b'x' | b'X') => (true, 1),
        _ => (false, 0),
    };
    let digits: &str = {
        let d = &s[digits_at..];
        let n = d.bytes().take_while(|b| if hex { b.is_ascii_hexdigit() } else { b.is_ascii_digit() }).count();
        &d[..n]
    };
    if digits.is_empty() {
        return None;
    }
    let mut len = digits_at + digits.len();
    if s[len..].starts_with(';') {
        len += 1;
    }
    // Python's int() takes any number of digits; past the code space it is U+FFFD anyway.
    let num = u32::from_str_radix(digits.trim_start_matches('0'), if hex { 16 } else { 10 })
        .unwrap_or(if digits.trim_start_matches('0').is_empty() { 0 } else { u32::MAX });
    Some((len, python_charref(num)))
}

fn python_charref(num: u32) -> String {
    match num {
        0 => return "\u{fffd}".into(),
        0x0d => return "\r".into(),
        0x80..=0x9f => return c1_control(char::from_u32(num).expect("a C1 control")).to_string(),
        0xd800..=0xdfff | 0x110000.. => return "\u{fffd}".into(),
        _ => {}
    }
    let invalid = matches!(num, 0x1..=0x8 | 0xb | 0xe..=0x1f | 0x7f | 0xfdd0..=0xfdef) || (num & 0xfffe) == 0xfffe;
    if invalid {
        return String::new();
    }
    char::from_u32(num).map(String::from).unwrap_or_default()
}

/// A named reference after its `&`: up to 32 name characters and an optional `;`, or failing
/// that its longest prefix (of at least two characters) that is an HTML5 name, as Python reads it.
fn named_ref(s: &str) -> Option<(usize, String)> {
    let name_len: usize =
        s.chars().take_while(|c| !matches!(c, '\t' | '\n' | '\u{c}' | ' ' | '<' | '&' | '#' | ';')).take(32).map(char::len_utf8).sum();
    if name_len == 0 {
        return None;
    }
    let with_semi = name_len + usize::from(s[name_len..].starts_with(';'));
    let candidate = &s[..with_semi];
    let whole = format!("&{candidate}");
    if let Some(u) = named_exact_or_legacy(&whole) {
        return Some((with_semi, u));
    }
    // Longest prefix first; Python tries s[:x] for x from len-1 down to 2.
    let bounds: Vec<usize> = candidate.char_indices().map(|(i, _)| i).filter(|&i| i >= 2).collect();
    for &x in bounds.iter().rev() {
        if let Some(u) = named_exact_or_legacy(&format!("&{}", &candidate[..x])) {
            return Some((x, u));
        }
    }
    None
}

/// The character of `&name;` or of a legacy `&name` (the entities HTML5 lists without their
/// semicolon), when the whole of `s` is that entity.
fn named_exact_or_legacy(s: &str) -> Option<String> {
    if s.ends_with(';') {
        return named_exact(s);
    }
    // Unescaped in attribute context, a legacy name followed by nothing is still expanded, and a
    // name that is not an entity is left as it is.
    let u = htmlize::unescape_attribute(s);
    (u != s).then(|| u.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pythons_html_unescape() {
        for (text, want) in [
            ("&amp;amp;", "&amp;"),
            ("&eacute; &Eacute &eacutex &notit; &#233;&#xE9;&#Xe9", "é É éx ¬it; ééé"),
            ("&#0; &#128; &#x81; &#1; &#xD800; &#1114112; &#65534;", "\u{fffd} € \u{81}  \u{fffd} \u{fffd} "),
            ("a & b &; &# &x; &am", "a & b &; &# &x; &am"),
        ] {
            assert_eq!(html_unescape(text), want, "{text:?}");
        }
    }

    #[test]
    fn ftfys_repairs_of_text_that_is_not_mojibake() {
        for (text, want) in [
            ("ﬁsh ﬂour ĳs", "fish flour ijs"),
            ("ＡＢＣ１２３！　ｶﾀｶﾅ", "ABC123! カタカナ"),
            ("\u{2018}a\u{2019} \u{201c}b\u{201d} \u{2bc}", "'a' \"b\" '"),
            ("&amp;amp;lt; &EACUTE; &NotAnEntity;", "< É &NotAnEntity;"),
            ("<b>&amp;</b>", "<b>&amp;</b>"),
            ("a\r\nb\rc\u{2028}d", "a\nb\nc\nd"),
            ("\u{1b}[31mred\u{1b}[0m \u{feff}x\u{7}", "red x"),
            ("\u{93}quoted\u{94}", "\"quoted\""),
            ("e\u{301}", "é"),
            ("cafÃ© with sÃ¶ren, donâ€™t, Ð¿Ñ€Ð¸Ð²ÐµÑ‚", "café with sören, don't, привет"),
            ("«CAFÉ» and SÃO", "«CAFÉ» and SÃO"),
        ] {
            assert_eq!(fix_text(text), want, "{text:?}");
        }
    }

    #[test]
    fn the_three_modes() {
        let text = "  A ﬁne_DAY &amp;amp;amp; “fun”!\t";
        assert_eq!(Clean::Lower.apply(text), "a fine_day & \"fun\"!");
        assert_eq!(Clean::Whitespace.apply(text), "A fine_DAY & \"fun\"!");
        assert_eq!(Clean::Canonicalize.apply(text), "a fine day fun");
    }
}
