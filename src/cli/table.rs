//! Plain-text result tables for people (`--json` gives machines the same numbers).

use align::eval::metrics::{ClassificationReport, RetrievalReport};

pub struct Table {
    rows: Vec<(String, String)>,
    title: String,
}

impl Table {
    pub fn new(title: &str) -> Self {
        Table { rows: Vec::new(), title: title.into() }
    }

    pub fn row(&mut self, key: impl Into<String>, value: impl Into<String>) -> &mut Self {
        self.rows.push((key.into(), value.into()));
        self
    }

    pub fn print(&self) {
        let kw = self.rows.iter().map(|r| r.0.chars().count()).max().unwrap_or(0).max(8);
        let vw = self.rows.iter().map(|r| r.1.chars().count()).max().unwrap_or(0).max(8);
        println!("{}", self.title);
        println!("{}", "-".repeat(kw + vw + 3));
        for (k, v) in &self.rows {
            println!("{k:<kw$}   {v:>vw$}");
        }
        println!();
    }
}

pub fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

pub fn add_retrieval(t: &mut Table, r: &RetrievalReport) {
    t.row("image→text R@1 / R@5 / R@10", format!("{} / {} / {}", pct(r.i2t.r1), pct(r.i2t.r5), pct(r.i2t.r10)));
    t.row("text→image R@1 / R@5 / R@10", format!("{} / {} / {}", pct(r.t2i.r1), pct(r.t2i.r5), pct(r.t2i.r10)));
    t.row("rsum", format!("{:.1}", r.rsum));
    t.row("images / captions", format!("{} / {}", r.images, r.texts));
}

pub fn add_zeroshot(t: &mut Table, z: &ClassificationReport) {
    t.row("zero-shot top-1", pct(z.top1));
    t.row("zero-shot top-5", pct(z.top5));
    t.row("images / classes", format!("{} / {}", z.images, z.classes));
}
