//! The golden fixtures are exactly what `cargo xtask golden` wrote: every file under
//! golden/models, golden/refs and golden/quant is listed in golden/manifest.json with its
//! sha256 and size, and nothing else is there. A hand-edited or stray fixture fails here.

use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const HASHED_DIRS: [&str; 3] = ["models", "refs", "quant"];

fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("golden")
}

/// `files` of the manifest: path relative to golden/ -> (sha256 hex, size in bytes).
fn listed_files() -> BTreeMap<String, (String, u64)> {
    let path = golden().join("manifest.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let manifest: serde_json::Value =
        serde_json::from_str(&text).expect("manifest.json is not JSON");
    let files = manifest["files"]
        .as_object()
        .expect("manifest.json has no `files` object");
    files
        .iter()
        .map(|(name, entry)| {
            let sha = entry["sha256"]
                .as_str()
                .unwrap_or_else(|| panic!("{name}: no sha256"));
            let bytes = entry["bytes"]
                .as_u64()
                .unwrap_or_else(|| panic!("{name}: no bytes"));
            (name.clone(), (sha.to_string(), bytes))
        })
        .collect()
}

fn sha256_hex(path: &Path) -> String {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Sha256::digest(&data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn every_listed_fixture_has_its_recorded_hash() {
    let files = listed_files();
    assert!(
        files.keys().any(|f| f.starts_with("models/")),
        "manifest lists no models"
    );
    assert!(
        files.keys().any(|f| f.starts_with("refs/")),
        "manifest lists no references"
    );
    let mut wrong = Vec::new();
    for (name, (sha, bytes)) in &files {
        let path = golden().join(name);
        let size = std::fs::metadata(&path)
            .map(|m| m.len())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        if size != *bytes || sha256_hex(&path) != *sha {
            wrong.push(format!(
                "{name}: {size} bytes, manifest says {bytes} bytes / {sha}"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "fixtures differ from golden/manifest.json (rerun `cargo xtask golden`):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_fixture_is_missing_from_the_manifest() {
    let files = listed_files();
    let mut stray = Vec::new();
    for dir in HASHED_DIRS {
        let Ok(entries) = std::fs::read_dir(golden().join(dir)) else {
            continue;
        };
        for entry in entries {
            let entry = entry.expect("readable golden folder");
            let name = format!("{dir}/{}", entry.file_name().to_string_lossy());
            if !files.contains_key(&name) {
                stray.push(name);
            }
        }
    }
    assert!(
        stray.is_empty(),
        "files not listed in golden/manifest.json: {stray:?}"
    );
}
