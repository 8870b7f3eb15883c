//! A 64-bit perceptual hash (the DCT hash): the image as 32×32 grey levels, its 2-D DCT-II, and
//! one bit per low-frequency coefficient of the top-left 8×8 block, set when the coefficient
//! exceeds their median. Resizing, re-encoding and mild colour changes move few bits; a
//! horizontal flip is caught by also indexing each evaluation image's mirror.

use image::RgbImage;

const N: usize = 32;
const K: usize = 8;

fn dct_matrix() -> &'static [[f64; N]; K] {
    static M: std::sync::OnceLock<[[f64; N]; K]> = std::sync::OnceLock::new();
    M.get_or_init(|| {
        let mut m = [[0.0; N]; K];
        for (u, row) in m.iter_mut().enumerate() {
            for (x, v) in row.iter_mut().enumerate() {
                *v = ((2 * x + 1) as f64 * u as f64 * std::f64::consts::PI / (2 * N) as f64).cos();
            }
        }
        m
    })
}

/// 32×32 luma by area averaging (every source pixel counts, so the hash does not depend on
/// the source resolution).
fn grey32(img: &RgbImage) -> [[f64; N]; N] {
    let (w, h) = (img.width() as usize, img.height() as usize);
    let mut sum = [[0.0f64; N]; N];
    let mut count = [[0.0f64; N]; N];
    for (x, y, p) in img.enumerate_pixels() {
        let (gx, gy) = (x as usize * N / w, y as usize * N / h);
        sum[gy][gx] += 0.299 * p[0] as f64 + 0.587 * p[1] as f64 + 0.114 * p[2] as f64;
        count[gy][gx] += 1.0;
    }
    let mut g = [[0.0; N]; N];
    for y in 0..N {
        for x in 0..N {
            g[y][x] = if count[y][x] > 0.0 { sum[y][x] / count[y][x] } else { 0.0 };
        }
    }
    // Images under 32 px leave cells empty: fill them from the nearest filled cell to the left/up.
    if w < N || h < N {
        for y in 0..N {
            for x in 0..N {
                if count[y][x] == 0.0 {
                    let (sx, sy) = ((x * w / N).min(w - 1), (y * h / N).min(h - 1));
                    let p = img.get_pixel(sx as u32, sy as u32);
                    g[y][x] = 0.299 * p[0] as f64 + 0.587 * p[1] as f64 + 0.114 * p[2] as f64;
                }
            }
        }
    }
    g
}

fn hash_grey(g: &[[f64; N]; N]) -> u64 {
    let m = dct_matrix();
    // Rows first (8 frequencies per row), then columns.
    let mut rows = [[0.0; K]; N];
    for y in 0..N {
        for u in 0..K {
            rows[y][u] = (0..N).map(|x| m[u][x] * g[y][x]).sum();
        }
    }
    let mut coef = [0.0; K * K];
    for v in 0..K {
        for u in 0..K {
            coef[v * K + u] = (0..N).map(|y| m[v][y] * rows[y][u]).sum();
        }
    }
    // The DC term only measures brightness; the median is taken without it.
    let mut ac: Vec<f64> = coef[1..].to_vec();
    ac.sort_by(f64::total_cmp);
    let median = (ac[31] + ac[32]) / 2.0;
    coef.iter().enumerate().fold(0u64, |h, (i, &c)| if c > median { h | (1 << i) } else { h })
}

pub fn phash(img: &RgbImage) -> u64 {
    hash_grey(&grey32(img))
}

/// The hash of the image and of its mirror image.
pub fn phash_with_mirror(img: &RgbImage) -> [u64; 2] {
    let g = grey32(img);
    let mut m = g;
    for row in m.iter_mut() {
        row.reverse();
    }
    [hash_grey(&g), hash_grey(&m)]
}

pub fn distance(a: u64, b: u64) -> u32 {
    (a ^ b).count_ones()
}

/// The evaluation images' hashes (each with its mirror), searched linearly: at 64 bits a scan
/// is a few cycles per entry, far below the cost of decoding the candidate.
#[derive(Default)]
pub struct NearIndex {
    hashes: Vec<u64>,
}

impl NearIndex {
    pub fn add(&mut self, img: &RgbImage) {
        self.hashes.extend(phash_with_mirror(img));
    }

    pub fn extend(&mut self, hashes: impl IntoIterator<Item = u64>) {
        self.hashes.extend(hashes);
    }

    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// The smallest distance to an indexed hash, if within `max`.
    pub fn nearest_within(&self, h: u64, max: u32) -> Option<u32> {
        self.hashes.iter().map(|&e| distance(e, h)).filter(|&d| d <= max).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::rng::Rng;

    /// A smooth random picture: a few random blobs on a gradient, like a photo at low frequency.
    pub fn picture(seed: u64, w: u32, h: u32) -> RgbImage {
        let mut rng = Rng::new(seed);
        let blobs: Vec<(f64, f64, f64, [f64; 3])> = (0..6)
            .map(|_| (rng.next_f64(), rng.next_f64(), 0.05 + 0.2 * rng.next_f64(), [rng.next_f64(), rng.next_f64(), rng.next_f64()]))
            .collect();
        RgbImage::from_fn(w, h, |x, y| {
            let (fx, fy) = (x as f64 / w as f64, y as f64 / h as f64);
            let mut c = [0.3 * fx, 0.3 * fy, 0.2];
            for (bx, by, r, col) in &blobs {
                let d2 = ((fx - bx).powi(2) + (fy - by).powi(2)) / (r * r);
                let a = (-d2).exp();
                for k in 0..3 {
                    c[k] = c[k] * (1.0 - a) + col[k] * a;
                }
            }
            image::Rgb(c.map(|v| (v.clamp(0.0, 1.0) * 255.0) as u8))
        })
    }

    fn jpeg_roundtrip(img: &RgbImage, quality: u8) -> RgbImage {
        let mut buf = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut buf, quality).encode_image(img).unwrap();
        image::load_from_memory(&buf).unwrap().to_rgb8()
    }

    #[test]
    fn the_dct_matches_a_direct_evaluation() {
        // Coefficient (v=1, u=2) of a known ramp, computed from the definition.
        let mut g = [[0.0; N]; N];
        for (y, row) in g.iter_mut().enumerate() {
            for (x, v) in row.iter_mut().enumerate() {
                *v = (x * 3 + y * 7 % 11) as f64;
            }
        }
        let m = dct_matrix();
        let direct: f64 = (0..N)
            .flat_map(|y| (0..N).map(move |x| (x, y)))
            .map(|(x, y)| {
                g[y][x]
                    * ((2 * x + 1) as f64 * 2.0 * std::f64::consts::PI / 64.0).cos()
                    * ((2 * y + 1) as f64 * 1.0 * std::f64::consts::PI / 64.0).cos()
            })
            .sum();
        let via_table: f64 = (0..N).flat_map(|y| (0..N).map(move |x| (x, y))).map(|(x, y)| g[y][x] * m[2][x] * m[1][y]).sum();
        assert!((direct - via_table).abs() < 1e-9);
    }

    #[test]
    fn resized_reencoded_and_mirrored_copies_stay_close_and_other_pictures_do_not() {
        let original = picture(1, 640, 480);
        let mut index = NearIndex::default();
        index.add(&original);
        let resized = image::imageops::resize(&original, 300, 225, image::imageops::FilterType::CatmullRom);
        let reencoded = jpeg_roundtrip(&resized, 60);
        let mirrored = image::imageops::flip_horizontal(&jpeg_roundtrip(&original, 80));
        for (what, img) in [("resized", &resized), ("re-encoded", &reencoded), ("mirrored", &mirrored)] {
            let d = index.nearest_within(phash(img), 64).unwrap();
            assert!(d <= 6, "{what} copy is {d} bits away");
        }
        let mut far = u32::MAX;
        for seed in 2..40 {
            far = far.min(index.nearest_within(phash(&picture(seed, 640, 480)), 64).unwrap());
        }
        assert!(far >= 14, "an unrelated picture came within {far} bits");
    }
}
