//! Secrets (API keys, the admin token) come from files or the environment,
//! never the command line, where every user of the machine can read them.

/// A secret given as a file (a compose or Kubernetes secret mounted at
/// /run/secrets/NAME): its contents, trimmed; an empty or unreadable file
/// is an error that names it. `what` names the setting in the message.
pub fn read_secret(path: &std::path::Path, what: &str) -> Result<String, String> {
    let s = std::fs::read_to_string(path)
        .map_err(|e| format!("{what}: cannot read {}: {e}", path.display()))?;
    let s = s.trim();
    if s.is_empty() {
        return Err(format!("{what}: {} is empty", path.display()));
    }
    Ok(s.to_string())
}

/// Warns (on stderr) for each of `flags` given on this process's command
/// line, where every user of the machine can read it in `ps`; `instead`
/// says how to give it. Secrets belong in files or the environment.
pub fn warn_secret_flags(service: &str, flags: &[(&str, &str)]) {
    for arg in std::env::args().skip(1) {
        for (flag, instead) in flags {
            if arg == *flag || arg.starts_with(&format!("{flag}=")) {
                eprintln!(
                    "{service}: warning: {flag} on the command line is visible to every user of this machine (ps); give it as {instead}"
                );
            }
        }
    }
}

/// `value`, or the secret in `file`; both given is an error.
pub fn value_or_secret_file(
    value: Option<String>,
    file: Option<&std::path::Path>,
    what: &str,
) -> Result<Option<String>, String> {
    match (value.filter(|v| !v.is_empty()), file) {
        (Some(_), Some(f)) => Err(format!(
            "{what} is given both as a value and as the file {}: give one",
            f.display()
        )),
        (v, None) => Ok(v),
        (None, Some(f)) => read_secret(f, what).map(Some),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_come_from_files_trimmed_and_bad_files_are_named() {
        let dir = std::env::temp_dir().join(format!("omni-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("token");
        std::fs::write(&f, "s3cret\n").unwrap();
        assert_eq!(read_secret(&f, "--x").unwrap(), "s3cret");
        assert_eq!(
            value_or_secret_file(None, Some(&f), "--x")
                .unwrap()
                .as_deref(),
            Some("s3cret")
        );
        assert_eq!(
            value_or_secret_file(Some("v".into()), None, "--x")
                .unwrap()
                .as_deref(),
            Some("v")
        );
        assert!(value_or_secret_file(Some("v".into()), Some(&f), "--x")
            .unwrap_err()
            .contains("give one"));
        std::fs::write(&f, " \n").unwrap();
        assert!(read_secret(&f, "--x").unwrap_err().contains("is empty"));
        let missing = dir.join("missing");
        assert!(read_secret(&missing, "--x")
            .unwrap_err()
            .contains("missing"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
