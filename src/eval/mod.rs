//! Evaluation: retrieval, zero-shot classification, and the metrics behind them.

pub mod embed;
pub mod knn;
pub mod linear_probe;
pub mod metrics;
pub mod periodic;
pub mod record;
pub mod retrieval;
pub mod score;
pub mod suite;
pub mod tasks;
pub mod zeroshot;
