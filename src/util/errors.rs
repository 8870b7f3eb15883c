//! An error as the one line a user reads: anyhow's chain of contexts joined by ": ", with
//! candle's errors unwrapped. candle attaches a stack backtrace to its errors whenever
//! RUST_BACKTRACE is set and prints it inside the message (20 to 30 frames for one shape
//! mismatch); the frames help a developer of candle, not someone whose file is wrong.

/// `e` on one line, without backtraces.
pub fn one_line(e: &anyhow::Error) -> String {
    let parts: Vec<String> = e
        .chain()
        .map(|cause| match cause.downcast_ref::<candle_core::Error>() {
            Some(c) => candle_line(c),
            None => cause.to_string(),
        })
        .collect();
    parts.join(": ")
}

fn candle_line(e: &candle_core::Error) -> String {
    use candle_core::Error;
    match e {
        Error::WithBacktrace { inner, .. } => candle_line(inner),
        Error::Context { inner, context } => format!("{context}: {}", candle_line(inner)),
        Error::WithPath { inner, path } => format!("{}: {}", path.display(), candle_line(inner)),
        other => other.to_string().lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candle_errors_lose_their_backtraces_and_keep_their_contexts() {
        let shape = candle_core::Error::ShapeMismatchBinaryOp {
            lhs: candle_core::Shape::from((2, 3)),
            rhs: candle_core::Shape::from((4, 3)),
            op: "matmul",
        };
        let traced =
            candle_core::Error::WithBacktrace { inner: Box::new(shape), backtrace: Box::new(std::backtrace::Backtrace::force_capture()) };
        assert!(traced.to_string().lines().count() > 3, "candle prints the frames itself");
        let e = anyhow::Error::new(traced.context("projecting the text")).context("evaluating runs/demo");
        let line = one_line(&e);
        assert!(!line.contains('\n'), "{line}");
        assert!(line.starts_with("evaluating runs/demo: projecting the text: shape mismatch in matmul"), "{line}");
        assert!(line.contains("[2, 3]") && line.contains("[4, 3]"), "{line}");
    }
}
