//! The omnictl reference (`docs/omnictl.md`), written from the same clap
//! definitions that parse the command line, so the two cannot drift: a test
//! compares the file with [`markdown`], and `omnictl reference` (hidden)
//! prints it to refresh the file.

use clap::CommandFactory;

/// Where the reference lives, from the repository root.
pub const PATH: &str = "docs/omnictl.md";

/// The whole reference: the top-level help, then each command's long help.
pub fn markdown() -> String {
    // Environment values would make the text depend on who generates it.
    let mut cli = crate::Cli::command()
        .mut_args(|a| a.hide_env_values(true))
        .bin_name("omnictl");
    cli.build();
    let mut out = String::from(
        "# omnictl reference\n\n\
         <!-- Generated from omnictl's clap definitions: `omnictl reference > docs/omnictl.md`.\n     \
         A test fails when this file and the code differ. -->\n\n\
         `omnictl` is omni's admin console and local launcher. Every command also\n\
         answers `--help`; this page is that text for all of them.\n\n",
    );
    out.push_str(&section("omnictl", &mut cli));
    let mut subs: Vec<clap::Command> = cli
        .get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
        .cloned()
        .collect();
    for sub in &mut subs {
        let name = format!("omnictl {}", sub.get_name());
        let mut sub = sub.clone().mut_args(|a| a.hide_env_values(true));
        out.push_str(&section(&name, &mut sub));
    }
    out
}

fn section(title: &str, cmd: &mut clap::Command) -> String {
    let help = cmd.render_long_help().to_string();
    let help: Vec<&str> = help.lines().map(str::trim_end).collect();
    format!(
        "## {title}\n\n```text\n{}\n```\n\n",
        help.join("\n").trim_end()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `docs/omnictl.md` is what the code would write; `OMNI_UPDATE_DOCS=1`
    /// rewrites it.
    #[test]
    fn the_reference_in_docs_is_the_code_s() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(PATH);
        let want = markdown();
        if std::env::var_os("OMNI_UPDATE_DOCS").is_some() {
            std::fs::write(&path, &want).unwrap();
        }
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            have == want,
            "{PATH} differs from omnictl's clap definitions: run `OMNI_UPDATE_DOCS=1 cargo test --release -p omnictl --lib reference` (or `omnictl reference > {PATH}`) and commit it"
        );
        for cmd in [
            "omnictl up",
            "omnictl plan",
            "omnictl rebalance",
            "omnictl generate",
        ] {
            assert!(want.contains(&format!("## {cmd}\n")), "{cmd} missing");
        }
        assert!(
            want.contains("--counts"),
            "the plan's --counts flag is documented"
        );
    }
}
