//! `gardener-extension-ferry`: the controller comes in the next step; this build holds the
//! pure parts (rendering, decisions, status) and their tests.

fn main() -> std::process::ExitCode {
    eprintln!("gardener-extension-ferry: the controller is not part of this build yet");
    std::process::ExitCode::from(2)
}
