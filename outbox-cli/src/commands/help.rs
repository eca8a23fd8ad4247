//! `outbox completions <shell>` and `outbox man`: generated from the command-line definition
//! itself ([`crate::opt::Opt`]) with clap's own crates (`clap_complete`, `clap_mangen`), so
//! they list every command and flag of this build. Neither reads the configuration.
//!
//! ```sh
//! outbox completions bash > /etc/bash_completion.d/outbox
//! outbox completions zsh > "${fpath[1]}/_outbox"
//! outbox completions fish > ~/.config/fish/completions/outbox.fish
//! outbox man | man -l -
//! outbox man --dir /usr/local/share/man/man1    # outbox.1, outbox-migrate.1, ...
//! ```

use std::io::Write;
use std::path::Path;

use clap::CommandFactory;

use crate::error::CliError;
use crate::opt::Opt;

/// Writes the completion script for `shell` to stdout.
pub fn completions(shell: clap_complete::Shell) -> Result<(), CliError> {
    let mut cmd = Opt::command();
    // Generated into memory first: `clap_complete` panics on a failed write, and printing
    // leaves a closed pipe (`| head`) to the binary's quiet exit.
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, "outbox", &mut script);
    // The script ends with a newline: the line-buffered stdout has written all of it here.
    print!("{}", String::from_utf8_lossy(&script));
    Ok(())
}

/// Prints `outbox.1`, or writes every page into `dir` (created when missing) and names them.
pub fn man(dir: Option<&Path>) -> Result<(), CliError> {
    let cmd = Opt::command();
    let Some(dir) = dir else {
        let mut out = std::io::stdout().lock();
        return clap_mangen::Man::new(cmd)
            .render(&mut out)
            .and_then(|()| out.flush())
            .map_err(|e| CliError::failed(format!("cannot write the man page: {e}")));
    };
    let failed = |e: std::io::Error| {
        CliError::config(
            format!("cannot write the man pages into {}: {e}", dir.display()),
            "pass a writable directory to --dir",
        )
    };
    std::fs::create_dir_all(dir).map_err(failed)?;
    clap_mangen::generate_to(cmd, dir).map_err(failed)?;
    let mut pages: Vec<String> = std::fs::read_dir(dir)
        .map_err(failed)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("outbox") && n.ends_with(".1"))
        .collect();
    pages.sort();
    println!("wrote {} man page(s) into {}:", pages.len(), dir.display());
    for p in pages {
        println!("  {p}");
    }
    Ok(())
}
