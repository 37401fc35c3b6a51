//! `omnictl certs`: the cluster's CA and a certificate per process for
//! mutual TLS (`omni_transport::tls`). Every certificate names
//! `omni.cluster`, which every omni client checks, and the process in its
//! common name; the CA's key stays with the operator (it signs the
//! certificate of a process that joins later: run `certs` again with the
//! same `--out` and new names).

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// The names of the compose stack's processes (deploy/), and omnictl's own.
pub const STACK_NAMES: &str = "coordinator,router,w0,w1,g0,g1,c0,executor,e0,omnictl";

#[derive(Args, Debug)]
pub struct CertsArgs {
    /// The folder to write into: ca.pem and ca.key (made once, then reused:
    /// keep ca.key off the cluster's machines), NAME.pem and NAME.key per
    /// process.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// The processes to make certificates for (comma-separated); a name is
    /// the certificate's common name, which the logs show.
    #[arg(long, value_delimiter = ',', default_value = STACK_NAMES)]
    pub names: Vec<String>,
    /// How long the process certificates stay valid, in days (the CA: ten
    /// years).
    #[arg(long, default_value_t = 825)]
    pub days: u32,
    /// Write over a process's existing certificate and key.
    #[arg(long)]
    pub force: bool,
}

pub fn run(a: &CertsArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&a.out)
        .with_context(|| format!("cannot make the folder {}", a.out.display()))?;
    let (issuer, made) = ca(&a.out)?;
    println!(
        "{} the cluster CA {}",
        if made { "made" } else { "reusing" },
        a.out.join("ca.pem").display()
    );
    let now = time::OffsetDateTime::now_utc();
    for name in a.names.iter().map(|n| n.trim()).filter(|n| !n.is_empty()) {
        if name.contains(['/', '\\']) || name.starts_with('.') || name == "ca" {
            anyhow::bail!("'{name}' cannot name a certificate file (and 'ca' is the CA's)");
        }
        let (cert_path, key_path) = (
            a.out.join(format!("{name}.pem")),
            a.out.join(format!("{name}.key")),
        );
        if !a.force && (cert_path.exists() || key_path.exists()) {
            println!(
                "kept {} (exists; --force makes it again)",
                cert_path.display()
            );
            continue;
        }
        let mut p = CertificateParams::default();
        p.distinguished_name = dn(name);
        p.subject_alt_names = vec![
            SanType::DnsName(omni_transport::tls::CLUSTER_NAME.try_into()?),
            SanType::DnsName(name.to_string().try_into()?),
        ];
        p.not_before = now - time::Duration::days(1);
        p.not_after = now + time::Duration::days(i64::from(a.days));
        p.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        // Every process is both: it serves and it calls.
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &issuer)?;
        write(&cert_path, cert.pem().as_bytes(), false)?;
        write(&key_path, key.serialize_pem().as_bytes(), true)?;
        println!("wrote {} and {}", cert_path.display(), key_path.display());
    }
    Ok(())
}

fn dn(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "omni");
    dn.push(DnType::CommonName, common_name);
    dn
}

/// The CA in `dir`, made there first if there is none; and whether it was
/// made now.
fn ca(dir: &Path) -> anyhow::Result<(Issuer<'static, KeyPair>, bool)> {
    let (cert_path, key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
    match (cert_path.exists(), key_path.exists()) {
        (true, true) => {
            let read = |p: &Path| {
                std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))
            };
            let key = KeyPair::from_pem(&read(&key_path)?)
                .with_context(|| format!("{} is no private key", key_path.display()))?;
            let issuer = Issuer::from_ca_cert_pem(&read(&cert_path)?, key)
                .with_context(|| format!("{} is no CA certificate", cert_path.display()))?;
            return Ok((issuer, false));
        }
        (false, false) => {}
        _ => anyhow::bail!(
            "{} holds one of ca.pem and ca.key but not the other: give a new folder, or put the missing one back",
            dir.display()
        ),
    }
    let now = time::OffsetDateTime::now_utc();
    let mut p = CertificateParams::default();
    // Named apart from other clusters' CAs, for the operator reading a
    // certificate.
    let tag = now.unix_timestamp_nanos() as u64 % 0xffff_ffff;
    p.distinguished_name = dn(&format!("omni cluster CA {tag:08x}"));
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p.not_before = now - time::Duration::days(1);
    p.not_after = now + time::Duration::days(3650);
    let key = KeyPair::generate()?;
    let cert = p.self_signed(&key)?;
    write(&cert_path, cert.pem().as_bytes(), false)?;
    write(&key_path, key.serialize_pem().as_bytes(), true)?;
    Ok((Issuer::new(p, key), true))
}

/// Writes `bytes` to `path`, readable by its owner alone when `secret`.
fn write(path: &Path, bytes: &[u8], secret: bool) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    if secret {
        o.mode(0o600);
    }
    let mut f = o
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("cannot write {}", path.display()))
}
