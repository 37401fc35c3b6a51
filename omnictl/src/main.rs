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
    let cli = omnictl::Cli::parse();
    if let Err(e) = omnictl::run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
