//! `omnictl`: parse the command line and hand over to the library.

use clap::Parser;

fn main() {
    omni_runtime::forget_empty_settings();
    // Die quietly when the reader goes away (`omnictl workers | head`), as
    // command-line tools do, instead of panicking on the closed pipe.
    // SAFETY: restoring the default action of a signal; nothing else runs yet.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // `up` reads the settings chain (omni.toml's [up], OMNI_UP_*, flags).
    let argv: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    if argv.first().is_some_and(|a| a == "up") {
        let env: Vec<(String, String)> = std::env::vars().collect();
        if let Err(e) = omnictl::up_from_chain(&argv[1..], &env) {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
        return;
    }
    let cli = omnictl::Cli::parse();
    if let Err(e) = omnictl::run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
