//! Shards written by the reference tools (webdataset's TarWriter, GNU tar) read as webdataset
//! itself reads them. Fixtures and expectations come from `scripts/make_wds_fixtures.py`.

use std::path::PathBuf;

use align::data::spec::ShardSource;
use align::data::tar_read::{read_shard_events, ShardEvent};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

#[test]
fn samples_match_what_webdataset_reads() {
    let expected: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap();
    for name in ["wds-writer.tar", "gnu-tar.tar"] {
        let events = read_shard_events(&ShardSource::File(fixture(name)));
        let got: Vec<serde_json::Value> = events
            .iter()
            .map(|e| match e {
                ShardEvent::Sample(s) => serde_json::json!({
                    "key": s.key,
                    "fields": s.fields.keys().collect::<Vec<_>>(),
                    "txt": s.fields.get("txt").map(|t| String::from_utf8(t.clone()).unwrap()),
                }),
                other => panic!("{name}: unexpected {other:?}"),
            })
            .collect();
        assert_eq!(serde_json::Value::Array(got), expected[name], "{name}");
    }
}

#[test]
fn fixture_images_decode() {
    use align::data::sample;
    use align::data::transform::decode;
    for name in ["wds-writer.tar", "gnu-tar.tar"] {
        for e in read_shard_events(&ShardSource::File(fixture(name))) {
            if let ShardEvent::Sample(s) = e {
                let img = decode(sample::image_bytes(&s).unwrap(), u32::MAX, 1 << 30, align::data::transform::Alpha::Drop).unwrap();
                assert!(img.width() >= 12, "{name} {}", s.key);
            }
        }
    }
}
