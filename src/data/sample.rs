//! From raw tar fields to what the towers need: an image, its caption(s) and an optional label.

use super::skips::reason;
use super::tar_read::RawSample;

/// Field names tried for the image, in order (img2dataset writes `jpg`).
pub const IMAGE_FIELDS: [&str; 5] = ["jpg", "jpeg", "png", "webp", "img"];

#[derive(Debug, Clone, PartialEq)]
pub struct Rejected {
    pub reason: &'static str,
    pub detail: String,
}

fn reject(reason: &'static str, detail: impl Into<String>) -> Rejected {
    Rejected { reason, detail: detail.into() }
}

pub fn image_bytes(s: &RawSample) -> Result<&[u8], Rejected> {
    IMAGE_FIELDS.iter().find_map(|f| s.fields.get(*f)).map(Vec::as_slice).ok_or_else(|| {
        reject(reason::MISSING_IMAGE, format!("no image field (have: {})", s.fields.keys().cloned().collect::<Vec<_>>().join(", ")))
    })
}

/// All captions of a sample: the lines of `txt` (Flickr30K / COCO evaluation shards carry five),
/// else the `captions` list or `caption` string of `json`. Empty lines are dropped.
pub fn captions(s: &RawSample) -> Result<Vec<String>, Rejected> {
    let lines: Vec<String> = if let Some(txt) = s.fields.get("txt") {
        let text = std::str::from_utf8(txt).map_err(|e| reject(reason::CAPTION_NOT_UTF8, format!("txt is not UTF-8: {e}")))?;
        text.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect()
    } else if let Some(json) = s.fields.get("json") {
        let v: serde_json::Value = serde_json::from_slice(json).map_err(|e| reject(reason::BAD_JSON, format!("json: {e}")))?;
        match (v.get("captions"), v.get("caption")) {
            (Some(serde_json::Value::Array(xs)), _) => {
                xs.iter().filter_map(|x| x.as_str()).map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect()
            }
            (_, Some(serde_json::Value::String(c))) => vec![c.trim().to_string()].into_iter().filter(|c| !c.is_empty()).collect(),
            _ => return Err(reject(reason::MISSING_CAPTION, "no txt field and no caption in json")),
        }
    } else {
        return Err(reject(reason::MISSING_CAPTION, "no txt or json field"));
    };
    if lines.is_empty() {
        return Err(reject(reason::EMPTY_CAPTION, "caption is empty"));
    }
    Ok(lines)
}

/// The class label from `cls` (ASCII integer, as webdataset writes it), if present.
pub fn label(s: &RawSample) -> Result<Option<i64>, Rejected> {
    match s.fields.get("cls") {
        None => Ok(None),
        Some(b) => {
            let t = std::str::from_utf8(b).map_err(|_| reject(reason::BAD_LABEL, "cls is not UTF-8"))?;
            t.trim().parse::<i64>().map(Some).map_err(|_| reject(reason::BAD_LABEL, format!("cls {:?} is not an integer", t.trim())))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn sample(fields: &[(&str, &[u8])]) -> RawSample {
        RawSample { key: "k".into(), index: 0, fields: fields.iter().map(|(k, v)| (k.to_string(), v.to_vec())).collect::<BTreeMap<_, _>>() }
    }

    #[test]
    fn captions_come_from_txt_lines_or_json() {
        assert_eq!(captions(&sample(&[("txt", b"one\n\n two \n")])).unwrap(), vec!["one", "two"]);
        assert_eq!(captions(&sample(&[("json", br#"{"caption": " hi "}"#)])).unwrap(), vec!["hi"]);
        assert_eq!(captions(&sample(&[("json", br#"{"captions": ["a", "b"]}"#)])).unwrap(), vec!["a", "b"]);
    }

    #[test]
    fn bad_captions_are_rejected_with_their_reason() {
        assert_eq!(captions(&sample(&[("jpg", b"x")])).unwrap_err().reason, "missing_caption");
        assert_eq!(captions(&sample(&[("txt", b"  \n")])).unwrap_err().reason, "empty_caption");
        assert_eq!(captions(&sample(&[("txt", b"\xff\xfe")])).unwrap_err().reason, "caption_not_utf8");
        assert_eq!(captions(&sample(&[("json", b"{")])).unwrap_err().reason, "bad_json");
    }

    #[test]
    fn labels_and_images_are_found_by_field_name() {
        assert_eq!(label(&sample(&[("cls", b" 17\n")])).unwrap(), Some(17));
        assert_eq!(label(&sample(&[])).unwrap(), None);
        assert_eq!(label(&sample(&[("cls", b"cat")])).unwrap_err().reason, "bad_label");
        assert_eq!(image_bytes(&sample(&[("png", b"p")])).unwrap(), b"p");
        assert_eq!(image_bytes(&sample(&[("txt", b"t")])).unwrap_err().reason, "missing_image");
    }
}
