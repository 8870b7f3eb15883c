//! `align data build`: every filter removes exactly the samples planted for it and keeps the rest;
//! the output reads back through the data pipeline; shuffling and reruns are deterministic.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use align::data::build::filters::Filters;
use align::data::build::{build, BuildOptions, BuildReport};
use align::data::shard_writer::ShardWriter;
use align::data::spec::ShardSource;
use align::data::tar_read::{read_shard_events, ShardEvent};
use align::util::rng::Rng;
use image::RgbImage;

/// A smooth random picture (blobs on a gradient), distinct per seed.
fn picture(seed: u64, w: u32, h: u32) -> RgbImage {
    let mut rng = Rng::new(seed.wrapping_mul(7919).wrapping_add(13));
    let blobs: Vec<[f64; 6]> = (0..6)
        .map(|_| [rng.next_f64(), rng.next_f64(), 0.05 + 0.2 * rng.next_f64(), rng.next_f64(), rng.next_f64(), rng.next_f64()])
        .collect();
    RgbImage::from_fn(w, h, |x, y| {
        let (fx, fy) = (x as f64 / w as f64, y as f64 / h as f64);
        let mut c = [0.3 * fx, 0.3 * fy, 0.2];
        for b in &blobs {
            let a = (-((fx - b[0]).powi(2) + (fy - b[1]).powi(2)) / (b[2] * b[2])).exp();
            for k in 0..3 {
                c[k] = c[k] * (1.0 - a) + b[3 + k] * a;
            }
        }
        image::Rgb(c.map(|v| (v.clamp(0.0, 1.0) * 255.0) as u8))
    })
}

fn jpeg(img: &RgbImage, quality: u8) -> Vec<u8> {
    let mut buf = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut buf, quality).encode_image(img).unwrap();
    buf
}

fn png(img: &RgbImage) -> Vec<u8> {
    let mut buf = std::io::Cursor::new(Vec::new());
    img.write_to(&mut buf, image::ImageFormat::Png).unwrap();
    buf.into_inner()
}

const WORDS: [&str; 8] = ["dog", "cat", "barn", "river", "tree", "boat", "house", "field"];

/// A caption of common words (each word appears in many captions, so no rare tokens).
fn caption(i: usize) -> String {
    format!("A {} near the {} and a {}", WORDS[i % 8], WORDS[(i / 8 + 3) % 8], WORDS[(i * 5 + 1) % 8])
}

struct Planted {
    shards: String,
    eval_dir: std::path::PathBuf,
    /// key → the filter that must remove it ("" = kept).
    expected: BTreeMap<String, &'static str>,
}

fn plant(dir: &Path) -> Planted {
    let eval_dir = dir.join("eval");
    std::fs::create_dir_all(&eval_dir).unwrap();
    for s in 0..3u64 {
        std::fs::write(eval_dir.join(format!("{s}.jpg")), jpeg(&picture(1000 + s, 400, 300), 90)).unwrap();
    }
    let mut expected = BTreeMap::new();
    let mut samples: Vec<(String, Vec<u8>, Option<String>)> = Vec::new();
    let mut add = |key: String, img: Vec<u8>, cap: Option<String>, filter: &'static str| {
        expected.insert(key.clone(), filter);
        samples.push((key, img, cap));
    };
    for i in 0..40 {
        add(format!("good{i:03}"), jpeg(&picture(i as u64, 320, 240), 90), Some(caption(i)), "");
    }
    // Kept after cropping its boilerplate suffix.
    add("trimmed".into(), jpeg(&picture(500, 320, 240), 90), Some(format!("{} - Stock Photo", caption(3))), "");
    add("wide".into(), jpeg(&picture(501, 900, 250), 90), Some(caption(5)), "aspect_ratio");
    add("small".into(), jpeg(&picture(502, 150, 150), 90), Some(caption(6)), "image_size");
    add("png".into(), png(&picture(503, 320, 240)), Some(caption(7)), "image_format");
    add("twowords".into(), jpeg(&picture(504, 320, 240), 90), Some("Red barn".into()), "word_count");
    add("permalink".into(), jpeg(&picture(505, 320, 240), 90), Some("Embedded image permalink".into()), "boilerplate");
    add("repeats".into(), jpeg(&picture(506, 320, 240), 90), Some("Dog dog dog dog cat".into()), "repeated_words");
    add("lowercase".into(), jpeg(&picture(507, 320, 240), 90), Some("a dog near the river".into()), "capitalization");
    add("rare".into(), jpeg(&picture(508, 320, 240), 90), Some("A dog near the zqxjv".into()), "rare_tokens");
    for i in 0..11 {
        add(
            format!("shared{i:02}"),
            jpeg(&picture(600 + i, 320, 240), 90),
            Some("A generic house near the river".into()),
            "caption_frequency",
        );
    }
    // One image with four different captions: over the limit of three.
    let popular = jpeg(&picture(700, 320, 240), 90);
    for i in 0..4 {
        add(format!("popular{i}"), popular.clone(), Some(caption(10 + i)), "image_frequency");
    }
    // The same image twice with two captions: the second is the duplicate.
    let twice = jpeg(&picture(701, 320, 240), 90);
    add("dup0".into(), twice.clone(), Some(caption(20)), "");
    add("dup1".into(), twice, Some(caption(21)), "duplicate_image");
    let mut corrupt = jpeg(&picture(702, 320, 240), 90);
    corrupt.truncate(corrupt.len() / 2);
    add("corrupt".into(), corrupt, Some(caption(22)), "undecodable");
    add("nocaption".into(), jpeg(&picture(703, 320, 240), 90), None, "unreadable");
    // A mirrored, resized, re-encoded copy of evaluation image 1001.
    let copy = image::imageops::flip_horizontal(&image::imageops::resize(
        &picture(1001, 400, 300),
        300,
        225,
        image::imageops::FilterType::Triangle,
    ));
    add("evalcopy".into(), jpeg(&copy, 70), Some(caption(23)), "near_duplicate_eval");

    // Interleave the planted samples with the good ones over three shards.
    let mut rng = Rng::new(3);
    rng.shuffle(&mut samples);
    // The first copy of a duplicated image is the one kept.
    let pos = |k: &str| samples.iter().position(|s| s.0 == k).unwrap();
    let (d0, d1) = (pos("dup0"), pos("dup1"));
    if d1 < d0 {
        samples.swap(d0, d1);
    }
    let shards_dir = dir.join("raw");
    std::fs::create_dir_all(&shards_dir).unwrap();
    for (n, chunk) in samples.chunks(samples.len().div_ceil(3)).enumerate() {
        let mut w = ShardWriter::create(&shards_dir.join(format!("{n:05}.tar"))).unwrap();
        for (key, img, cap) in chunk {
            let json = format!("{{\"key\": \"{key}\", \"status\": \"success\"}}");
            match cap {
                Some(c) => w.write_sample(key, &[("jpg", img.as_slice()), ("txt", c.as_bytes()), ("json", json.as_bytes())]).unwrap(),
                None => w.write_sample(key, &[("jpg", img.as_slice()), ("json", json.as_bytes())]).unwrap(),
            }
        }
        w.finish().unwrap();
    }
    Planted { shards: format!("{}/{{00000..00002}}.tar", shards_dir.display()), eval_dir, expected }
}

fn filters() -> Filters {
    let mut f: Filters = toml::from_str(
        r#"
        [image]
        formats = ["jpeg"]
        min_shorter_side = 200
        max_aspect_ratio = 3.0
        [text]
        min_words = 3
        max_words = 20
        max_repeated_fraction = 0.3
        require_capitalized_first_word = true
        trim_boilerplate = ["stock photo"]
        drop_boilerplate = ["embedded image permalink"]
        [text.rare]
        min_count = 2
        [frequency]
        max_images_per_caption = 10
        max_captions_per_image = 3
        [dedup]
        exact_images = true
        near_max_distance = 10
        [output]
        samples_per_shard = 16
        "#,
    )
    .unwrap();
    f.description = "test".into();
    f
}

fn read_samples(report: &BuildReport) -> Vec<(String, BTreeMap<String, Vec<u8>>)> {
    let mut out = Vec::new();
    for shard in &report.shards {
        for ev in read_shard_events(&ShardSource::File(shard.clone())) {
            match ev {
                ShardEvent::Sample(s) => out.push((s.key, s.fields)),
                other => panic!("bad output shard {}: {other:?}", shard.display()),
            }
        }
    }
    out
}

fn run(p: &Planted, out: &Path, shuffle: bool) -> BuildReport {
    let mut f = filters();
    f.output.shuffle = shuffle;
    build(&BuildOptions {
        input: p.shards.clone(),
        image_root: None,
        out: out.to_path_buf(),
        filters: f,
        exclude_near: vec![p.eval_dir.display().to_string()],
        quiet: true,
    })
    .unwrap()
}

#[test]
fn each_filter_removes_exactly_its_planted_samples() {
    let dir = tempfile::tempdir().unwrap();
    let p = plant(dir.path());
    let report = run(&p, &dir.path().join("out"), false);

    let mut want: BTreeMap<&str, u64> = BTreeMap::new();
    for f in p.expected.values().filter(|f| !f.is_empty()) {
        *want.entry(f).or_default() += 1;
    }
    let got: BTreeMap<&str, u64> = report.removed.iter().filter(|r| r.samples > 0).map(|r| (r.filter.as_str(), r.samples)).collect();
    assert_eq!(got, want);
    assert_eq!(report.input_samples, p.expected.len() as u64);

    let samples = read_samples(&report);
    let kept: BTreeSet<String> = samples.iter().map(|s| s.0.clone()).collect();
    let want_kept: BTreeSet<String> = p.expected.iter().filter(|(_, f)| f.is_empty()).map(|(k, _)| k.clone()).collect();
    assert_eq!(kept, want_kept);
    assert_eq!(report.kept, want_kept.len() as u64);
    // Shards of 16, in input order, with the caption's boilerplate cropped and the json kept.
    assert_eq!(report.shards.len(), want_kept.len().div_ceil(16));
    let trimmed = &samples.iter().find(|s| s.0 == "trimmed").unwrap().1;
    assert_eq!(std::str::from_utf8(&trimmed["txt"]).unwrap(), caption(3));
    assert!(std::str::from_utf8(&trimmed["json"]).unwrap().contains("\"status\": \"success\""));
    assert!(trimmed.contains_key("jpg"));
    // Distributions: the small and wide images are gone from the "after" side.
    assert_eq!(report.before.shorter_side.min, 150.0);
    assert!(report.after.shorter_side.min >= 240.0);
    assert!(report.after.aspect_ratio.max < 3.0);
    assert!(dir.path().join("out/build-report.json").is_file());
}

#[test]
fn shuffled_output_holds_the_same_samples_in_a_reproducible_order() {
    let dir = tempfile::tempdir().unwrap();
    let p = plant(dir.path());
    let plain = read_samples(&run(&p, &dir.path().join("plain"), false));
    let a = run(&p, &dir.path().join("a"), true);
    let b = run(&p, &dir.path().join("b"), true);
    let sa = read_samples(&a);
    let keys = |s: &[(String, BTreeMap<String, Vec<u8>>)]| s.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
    assert_eq!(keys(&sa), keys(&read_samples(&b)), "same seed, same order");
    assert_ne!(keys(&sa), keys(&plain), "shuffled");
    let (mut x, mut y) = (sa.clone(), plain.clone());
    x.sort();
    y.sort();
    assert_eq!(x, y, "same samples, same bytes");
    // Every shard but the last is full.
    let sizes: Vec<usize> = a.shards.iter().map(|s| read_shard_events(&ShardSource::File(s.clone())).len()).collect();
    assert!(sizes[..sizes.len() - 1].iter().all(|&n| n == 16), "{sizes:?}");
    assert!(!dir.path().join("a/.build").exists(), "staging buckets are removed");
    for (s1, s2) in a.shards.iter().zip(&b.shards) {
        assert_eq!(std::fs::read(s1).unwrap(), std::fs::read(s2).unwrap());
    }
}

#[test]
fn a_caption_table_with_an_image_root_builds_resized_shards() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    std::fs::create_dir_all(&images).unwrap();
    let mut tsv = String::from("caption\timage\n");
    for i in 0..5 {
        std::fs::write(images.join(format!("{i}.png")), png(&picture(i, 640, 480))).unwrap();
        tsv.push_str(&format!("{}\t{i}.png\n", caption(i as usize)));
    }
    tsv.push_str("A missing picture of a dog\tnope.png\n");
    let table = dir.path().join("pairs.tsv");
    std::fs::write(&table, tsv).unwrap();
    let mut f = Filters::default();
    f.output.resize_longer = 256;
    let r = build(&BuildOptions {
        input: table.display().to_string(),
        image_root: Some(images),
        out: dir.path().join("out"),
        filters: f,
        exclude_near: vec![],
        quiet: true,
    })
    .unwrap();
    assert_eq!((r.input_samples, r.kept), (6, 5));
    assert_eq!(r.removed.iter().find(|x| x.filter == "unreadable").unwrap().samples, 1);
    let samples = read_samples(&r);
    assert_eq!(samples.iter().map(|s| s.0.as_str()).collect::<Vec<_>>(), ["000000000", "000000001", "000000002", "000000003", "000000004"]);
    let img = image::load_from_memory(&samples[0].1["jpg"]).unwrap();
    assert_eq!((img.width(), img.height()), (256, 192));
}
