//! `pinfer bundle -m MODEL -o NAME`: one executable carrying its model (see `pinfer::bundle`).
//! `./NAME` then runs as pinfer with `-m` defaulting to its own file (bare `./NAME`: a chat).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Args;
use pinfer::bundle::{
    elf_end, inspect, Contents, Trailer, ALIGN, DAMAGED_TRAILER, FLAG_REPACKED, TRAILER_LEN,
};
use pinfer::loader::ModelFile;
use pinfer::output_file::OutputFile;
use pinfer::repack_cache;

use crate::CliError;

/// Options of `pinfer bundle`.
#[derive(Args, Debug)]
pub struct BundleArgs {
    /// Model file (GGUF, a repack cache, or another bundle). Default: the model fetched by
    /// scripts/setup.sh.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// The executable to write (written to a temporary file beside it, then renamed over it).
    #[arg(short = 'o', long = "output")]
    pub output: PathBuf,
    /// Carry the weights already repacked for the target CPU (a repack cache: the bundle then
    /// only maps them at start). For another architecture the target binary makes the cache,
    /// run under qemu-user.
    #[arg(long)]
    pub repacked: bool,
    /// The pinfer executable to bundle (default: this one), e.g. the aarch64 binary from
    /// `./x dist` to make a board's file on a PC.
    #[arg(long = "target-binary")]
    pub target_binary: Option<PathBuf>,
    /// Threads for repacking (default: every core this process may use).
    #[arg(short = 't', long = "threads", value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
}

/// The CPU architecture of an ELF executable (as `std::env::consts::ARCH` names it).
fn elf_arch(file: &mut File) -> Result<&'static str, String> {
    let mut head = [0u8; 20];
    file.seek(SeekFrom::Start(0)).map_err(|e| e.to_string())?;
    file.read_exact(&mut head).map_err(|_| "is not an executable".to_string())?;
    if &head[..4] != b"\x7fELF" {
        return Err("is not an executable (no ELF header)".into());
    }
    match u16::from_le_bytes([head[18], head[19]]) {
        183 => Ok("aarch64"),
        62 => Ok("x86_64"),
        m => Err(format!("is an executable for ELF machine {m}: pinfer runs on aarch64 and x86_64")),
    }
}

/// Writes the bundle and says what it did.
pub fn run(args: BundleArgs) -> Result<(), CliError> {
    let model_path = crate::model_path(args.model.clone())?;
    let exe = match &args.target_binary {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(|e| CliError::new(format!("this executable: {e}")))?,
    };
    let shown = exe.display().to_string();
    let mut exe_file = File::open(&exe).map_err(|e| CliError::new(format!("{shown}: {e}")))?;
    let arch = elf_arch(&mut exe_file).map_err(|e| CliError::new(format!("{shown} {e}")))?;
    // The executable part: everything up to its ELF image's end (a bundle's model dropped).
    match inspect(&mut exe_file).map_err(|e| CliError::new(format!("{shown}: {e}")))? {
        Contents::NotElf => return Err(CliError::new(format!("{shown} is not an executable"))),
        Contents::Plain | Contents::Bundle(_) => {}
    }
    let exe_len = elf_end(&mut exe_file)
        .map_err(|e| CliError::new(format!("{shown}: {e}")))?
        .ok_or_else(|| CliError::new(format!("{shown} is not an ELF64 executable")))?;
    // A pinfer that reads bundles holds this message among its constants.
    let mut image = Vec::new();
    exe_file
        .seek(SeekFrom::Start(0))
        .and_then(|_| (&mut exe_file).take(exe_len).read_to_end(&mut image))
        .map_err(|e| CliError::new(format!("{shown}: {e}")))?;
    let marker = DAMAGED_TRAILER.as_bytes();
    if !image.windows(marker.len()).any(|w| w == marker) {
        return Err(CliError::new(format!(
            "{shown} is not a pinfer that reads bundles (build it from this source)"
        )));
    }

    // The cache, when asked for, goes beside the output and is removed afterwards.
    let mut cache_file: Option<PathBuf> = None;
    let result = (|| {
        let source = if args.repacked {
            make_cache(&args, &model_path, arch, &mut cache_file)?
        } else {
            model_path.clone()
        };
        let model = ModelFile::open(&source)?;
        let gguf = model.parse()?;
        let is_cache = repack_cache::is_cache(&gguf);
        if is_cache {
            // A cache is for one architecture: refused for another one here, not on the board.
            let made_for = gguf.get_str_opt(repack_cache::KEY_ARCH).ok().flatten().unwrap_or("another CPU");
            if made_for != arch {
                return Err(CliError::new(format!(
                    "{}: a repack cache for {made_for}; the target binary runs on {arch}: bundle the original \
                     model (with --repacked to repack it for {arch})",
                    source.display()
                )));
            }
        }
        let bytes = model.bytes();
        let header_len = gguf.data_start();
        let trailer_for = |offset: u64| Trailer {
            flags: if is_cache { FLAG_REPACKED } else { 0 },
            model_offset: offset,
            model_len: bytes.len() as u64,
            header_len: header_len as u64,
            header_crc: crc32fast::hash(&bytes[..header_len]),
        };
        let offset = exe_len.next_multiple_of(ALIGN);
        let trailer = trailer_for(offset);

        let inputs: Vec<&Path> = vec![&exe, &source];
        let mut out = OutputFile::create(&args.output, &inputs)?;
        let oname = args.output.display().to_string();
        let werr = |e: std::io::Error| CliError::new(format!("{oname}: {e}"));
        {
            let mut file = out.file();
            if image.len() as u64 != exe_len {
                return Err(CliError::new(format!("{shown}: shorter than its ELF image")));
            }
            file.write_all(&image).map_err(werr)?;
            file.write_all(&vec![0u8; (offset - exe_len) as usize]).map_err(werr)?;
            // (Ctrl-C removes the temporary output: see `signals`.)
            file.write_all(bytes).map_err(werr)?;
            file.write_all(&trailer.encode()).map_err(werr)?;
            use std::os::unix::fs::PermissionsExt;
            file.set_permissions(std::fs::Permissions::from_mode(0o755)).map_err(werr)?;
        }
        out.commit()?;
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        outln!(
            "bundled {} ({:.1} MiB{}) into {oname} for {arch}: {:.1} MiB executable + model at offset {offset}, \
             {:.1} MiB in all; run ./{} generate -p ... (bare: a chat)",
            model_path.display(),
            mib(bytes.len() as u64),
            if is_cache { ", repacked" } else { "" },
            mib(exe_len),
            mib(offset + bytes.len() as u64 + TRAILER_LEN as u64),
            args.output.file_name().map_or(oname.clone(), |n| n.to_string_lossy().into_owned())
        )?;
        Ok(())
    })();
    if let Some(tmp) = cache_file {
        let _ = std::fs::remove_file(tmp);
    }
    result
}

/// Makes the repack cache of `model` for `arch` beside the output (its path in `made`): here when
/// this machine is `arch`, else by the target binary under qemu-user.
fn make_cache(
    args: &BundleArgs,
    model: &Path,
    arch: &str,
    made: &mut Option<PathBuf>,
) -> Result<PathBuf, CliError> {
    let dir = match args.output.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = args.output.file_name().map_or("bundle".into(), |n| n.to_string_lossy().into_owned());
    let cache = dir.join(format!(".{name}.repack-{}.gguf", std::process::id()));
    *made = Some(cache.clone());
    if arch == repack_cache::ARCH && args.target_binary.is_none() {
        let threads = crate::worker_threads(args.threads);
        let _polled = crate::signals::Polled::start();
        match repack_cache::write_cache(model, &cache, threads, &crate::signals::INTERRUPTED) {
            Err(repack_cache::CacheError::Interrupted) => return Err(CliError::Interrupted),
            other => other?,
        };
        return Ok(cache);
    }
    // The target binary repacks with its own code: under qemu-user for another architecture.
    let target = args.target_binary.clone().unwrap_or_else(|| PathBuf::from("pinfer"));
    let mut cmd = if arch == std::env::consts::ARCH {
        Command::new(&target)
    } else {
        let mut c = Command::new(format!("qemu-{arch}"));
        if arch == "aarch64" {
            // The board's CPU: the kernels (and so the layouts) it selects.
            c.args(["-cpu", "cortex-a76"]);
        }
        c.arg(&target);
        c
    };
    cmd.arg("repack").arg(model).arg(&cache).stdout(std::process::Stdio::null());
    if let Some(t) = args.threads {
        cmd.args(["-t", &t.to_string()]);
    }
    let status = cmd.status().map_err(|e| {
        CliError::new(format!(
            "running {} to repack for {arch}: {e} (install qemu-user, or bundle without --repacked)",
            cmd.get_program().to_string_lossy()
        ))
    })?;
    if !status.success() {
        return Err(CliError::new(format!("{} repack failed ({status})", target.display())));
    }
    Ok(cache)
}
