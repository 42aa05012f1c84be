//! What both benchmarks read of a callgrind run (`--instructions`).

/// The total instruction count callgrind prints when the program ends.
pub fn collected(stderr: &str) -> Option<u64> {
    stderr
        .lines()
        .filter_map(|line| line.split("Collected :").nth(1))
        .filter_map(|count| count.trim().parse().ok())
        .next_back()
}

#[cfg(test)]
mod tests {
    use super::collected;

    #[test]
    fn reads_the_last_collected_line() {
        let stderr =
            "==1== Events    : Ir\n==1== Collected : 1234\n==1==\n==1== I   refs:      1,234\n";
        assert_eq!(collected(stderr), Some(1234));
        assert_eq!(collected("nothing"), None);
    }
}
