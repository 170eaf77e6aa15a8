//! The README's commands, so that none of them rots. Every command in its
//! ```sh blocks runs somewhere: a `strata` command here, with the built
//! binary, in a fresh directory per block (the files it names copied
//! there, a long run cut short by a documented flag), and any other
//! command in CI, as a line of `.ci/run` or through `RUN_BY_CI_AS`. The
//! README also stays short, and tells no history of who measured what.

use std::path::Path;
use std::process::{Command, Output};

/// The README's most lines (the issue asks for about 250).
const README_LINES_MAX: usize = 260;

/// Words of history told by sitting rather than by date and commit.
const HISTORY_WORDS: [&str; 2] = ["session", "sitting"];

/// The languages a README code block may name; every shell block is `sh`,
/// so that none escapes the checks below.
const FENCE_LANGUAGES: [&str; 6] = ["sh", "python", "rust", "toml", "json", "text"];

/// README commands that CI runs in another form: (the README's command,
/// the line of `.ci/run` that runs it).
const RUN_BY_CI_AS: [(&str, &str); 5] = [
    // The MPI build, and two processes of the two-rank example under
    // mpirun against its two threads: the test builds the binary with the
    // feature and runs the example's model and placement that way.
    (
        "cargo build --release --features mpi",
        "STRATA_REQUIRE_MPI=1 cargo test -p strata --features mpi --test mpi",
    ),
    (
        "mpirun -n 2 strata train --config examples/configs/zero3-2rank.toml",
        "STRATA_REQUIRE_MPI=1 cargo test -p strata --features mpi --test mpi",
    ),
    // torchrun's two processes of the two-rank example against its two
    // threads, once CI has installed torch.
    (
        "torchrun --standalone --nproc-per-node 2 --no-python strata train --config examples/configs/zero3-2rank.toml",
        "STRATA_REQUIRE_TORCHRUN=1 cargo test -p strata --test nproc torchrun",
    ),
    // `cargo run --release` builds the same release binary first.
    ("cargo build --release", "cargo run --release -- train"),
    // The same package through the same build backend (maturin), as the
    // manylinux wheel CI then installs and tests.
    (
        "pip install ./python",
        "python3 -m maturin build --release --zig --compatibility manylinux_2_28 -m python/Cargo.toml -o target/wheels",
    ),
];

/// Files a README command names that the repository does not hold under
/// that name: (the name, the repository file copied there, directories
/// made beside it).
const FIXTURES: [(&str, &str, &[&str]); 1] = [(
    "ds_config.json",
    "examples/configs/deepspeed/zero3-infinity-nvme.json",
    // Its nvme_path, which must exist.
    &["strata-train-swap"],
)];

/// How a `strata` command that would run long is cut short here: a
/// command starting with `command` gets `append`, unless it already has
/// one of `unless`.
struct Brief {
    command: &'static [&'static str],
    unless: &'static [&'static str],
    append: &'static [&'static str],
}

const BRIEF: [Brief; 2] = [
    Brief {
        command: &["train"],
        unless: &["--stop-after", "--resume", "--print-config"],
        append: &["--stop-after", "2"],
    },
    Brief {
        command: &["bench", "nvme"],
        unless: &["--size", "--queue-depth"],
        append: &["--size", "8MiB", "--queue-depth", "8"],
    },
];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|err| panic!("{path}: {err}"))
}

fn tempdir() -> tempfile::TempDir {
    // Under target/, on the real disk: /tmp may be tmpfs, which the drive
    // bench refuses.
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// One ```sh block of the README: the line its fence is on, and its
/// commands (comments dropped, `\` continuations joined, spaces single).
struct Block {
    line: usize,
    commands: Vec<String>,
}

/// The README's ```sh blocks; panics on a code block that names no
/// language or one outside `FENCE_LANGUAGES`.
fn sh_blocks(text: &str) -> Vec<Block> {
    enum Fence {
        Outside,
        Shell(Block, String),
        Other,
    }
    let mut blocks = Vec::new();
    let mut fence = Fence::Outside;
    for (index, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let number = index + 1;
        fence = match fence {
            Fence::Outside => match line.strip_prefix("```") {
                Some("sh") => Fence::Shell(
                    Block {
                        line: number,
                        commands: Vec::new(),
                    },
                    String::new(),
                ),
                Some(language) => {
                    assert!(
                        FENCE_LANGUAGES.contains(&language),
                        "README.md:{number}: a code block's fence names {language:?}; \
                         name one of {FENCE_LANGUAGES:?} (shell commands go in ```sh)"
                    );
                    Fence::Other
                }
                None => Fence::Outside,
            },
            Fence::Other if line == "```" => Fence::Outside,
            Fence::Other => Fence::Other,
            Fence::Shell(block, pending) if line == "```" => {
                assert!(
                    pending.is_empty(),
                    "README.md:{number}: the block ends inside a `\\` continuation"
                );
                blocks.push(block);
                Fence::Outside
            }
            Fence::Shell(mut block, mut pending) => {
                let code = match line.find(" #") {
                    _ if line.starts_with('#') => "",
                    Some(at) => line[..at].trim_end(),
                    None => line,
                };
                match code.strip_suffix('\\') {
                    Some(head) => {
                        pending.push_str(head);
                        pending.push(' ');
                    }
                    None => {
                        pending.push_str(code);
                        let command = pending.split_whitespace().collect::<Vec<_>>().join(" ");
                        if !command.is_empty() {
                            block.commands.push(command);
                        }
                        pending.clear();
                    }
                }
                Fence::Shell(block, pending)
            }
        };
    }
    assert!(
        matches!(fence, Fence::Outside),
        "README.md: a code block is never closed"
    );
    blocks
}

fn ci_lines() -> Vec<String> {
    read(".ci/run")
        .lines()
        .map(|line| line.trim().to_string())
        .collect()
}

#[test]
fn readme_is_short_and_dates_no_history_by_sitting() {
    let text = read("README.md");
    let lines = text.lines().count();
    assert!(
        lines <= README_LINES_MAX,
        "README.md has {lines} lines, more than {README_LINES_MAX}: move detail to docs/"
    );
    for (index, line) in text.lines().enumerate() {
        let lower = line.to_lowercase();
        for word in HISTORY_WORDS {
            assert!(
                !lower.contains(word),
                "README.md:{}: {word:?} in {line:?}: records go to docs/ by date, machine and commit",
                index + 1
            );
        }
    }
}

#[test]
fn readme_commands_other_than_strata_are_run_by_ci() {
    let ci = ci_lines();
    let blocks = sh_blocks(&read("README.md"));
    let others: Vec<&str> = blocks
        .iter()
        .flat_map(|block| &block.commands)
        .map(String::as_str)
        .filter(|command| !command.starts_with("strata "))
        .collect();
    assert!(
        others.contains(&"cargo run --release -- train"),
        "the README's main job (`cargo run --release -- train`) is not in a ```sh block"
    );
    for &command in &others {
        let runs = RUN_BY_CI_AS
            .iter()
            .find(|(readme, _)| *readme == command)
            .map_or(command, |(_, line)| *line);
        assert!(
            ci.iter().any(|line| line == runs),
            "README command {command:?}: .ci/run has no line {runs:?}; run it there, \
             or map it in RUN_BY_CI_AS to the CI line that runs it"
        );
    }
    // The map lists only commands the README gives.
    for (readme, _) in RUN_BY_CI_AS {
        assert!(
            others.contains(&readme),
            "RUN_BY_CI_AS maps {readme:?}, which the README no longer gives"
        );
    }
}

/// Copies into `dir` the files `args` name: repository files under their
/// own relative path, and `FIXTURES` under theirs.
fn prepare(dir: &Path, args: &[String]) {
    for arg in args.iter().filter(|arg| !arg.starts_with('-')) {
        let fixture = FIXTURES.iter().find(|(name, _, _)| *name == arg.as_str());
        let source = match fixture {
            Some((_, source, _)) => root().join(source),
            None if Path::new(arg).is_relative() && root().join(arg).is_file() => root().join(arg),
            None => continue,
        };
        let target = dir.join(arg);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(&source, &target).unwrap_or_else(|err| {
            panic!("copy {} to {}: {err}", source.display(), target.display())
        });
        if let Some((_, _, made)) = fixture {
            for made in made.iter() {
                std::fs::create_dir_all(dir.join(made)).unwrap();
            }
        }
    }
}

/// The flags that cut `args` short here (none if it is short already).
fn brief(args: &[String]) -> Vec<String> {
    let named = |flag: &str| args.iter().any(|arg| arg == flag);
    BRIEF
        .iter()
        .find(|b| {
            b.command.len() <= args.len()
                && b.command
                    .iter()
                    .zip(args)
                    .all(|(word, arg)| *word == arg.as_str())
        })
        .filter(|b| !b.unless.iter().any(|flag| named(flag)))
        .map(|b| b.append.iter().map(|flag| flag.to_string()).collect())
        .unwrap_or_default()
}

fn strata_in(dir: &Path, args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .current_dir(dir)
        .env("STRATA_LOG", "warn")
        .output()
        .expect("strata runs")
}

#[test]
fn readme_strata_commands_run() {
    let blocks = sh_blocks(&read("README.md"));
    let mut ran = 0;
    for block in &blocks {
        let commands: Vec<&String> = block
            .commands
            .iter()
            .filter(|command| command.starts_with("strata "))
            .collect();
        if commands.is_empty() {
            continue;
        }
        // One directory per block: a later command reads what an earlier
        // one wrote (a checkpoint to resume).
        let dir = tempdir();
        for command in commands {
            let mut args: Vec<String> = command
                .split_whitespace()
                .skip(1)
                .map(String::from)
                .collect();
            assert!(
                !command.contains(['"', '\'', '$', '|', '>', '<', ';', '&', '`']),
                "README.md:{}: {command:?} needs a shell; keep README commands plain",
                block.line
            );
            prepare(dir.path(), &args);
            args.extend(brief(&args));
            let output = strata_in(dir.path(), &args);
            assert!(
                output.status.success(),
                "README.md:{}: `strata {}` failed ({}):\n{}{}",
                block.line,
                args.join(" "),
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
            ran += 1;
        }
    }
    assert!(
        ran >= 5,
        "only {ran} strata commands in the README's ```sh blocks"
    );
}

#[test]
fn sh_blocks_join_continuations_and_drop_comments() {
    let text = "intro\n```sh\n# a comment\nstrata plan --params 13B \\\n    --compare   # inline\n\ncargo test\n```\n```python\nx = 1\n```\n";
    let blocks = sh_blocks(text);
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks[0].line, 2);
    assert_eq!(
        blocks[0].commands,
        ["strata plan --params 13B --compare", "cargo test"]
    );
    let args: Vec<String> = ["train", "--steps", "9"].map(String::from).to_vec();
    assert_eq!(brief(&args), ["--stop-after", "2"]);
    let resume: Vec<String> = ["train", "--resume", "ckpt"].map(String::from).to_vec();
    assert!(brief(&resume).is_empty());
}
