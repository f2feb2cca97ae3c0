//! Certificates for migrations over TLS (kumo's `tls_dir`: `ca.pem`, `cert.pem`, `key.pem`),
//! made in the test with rcgen.

use std::path::Path;

/// A CA that signs the certificates of TLS directories.
pub struct Pki {
    ca: rcgen::Certificate,
    key: rcgen::KeyPair,
}

impl Pki {
    /// A new self-signed CA whose common name is `name`.
    pub fn new(name: &str) -> Pki {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().expect("CA key");
        let ca = p.self_signed(&key).expect("CA certificate");
        Pki { ca, key }
    }

    /// A TLS directory at `dir` whose certificate names `names` (host names or IP addresses)
    /// and whose ca.pem is this CA; its path as text.
    pub fn dir(&self, dir: &Path, names: &[&str]) -> String {
        std::fs::create_dir_all(dir).expect("TLS directory");
        let p = rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .expect("certificate parameters");
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = p.signed_by(&key, &self.ca, &self.key).expect("certificate");
        std::fs::write(dir.join("ca.pem"), self.ca.pem()).expect("ca.pem");
        std::fs::write(dir.join("cert.pem"), cert.pem()).expect("cert.pem");
        std::fs::write(dir.join("key.pem"), key.serialize_pem()).expect("key.pem");
        dir.to_str().expect("UTF-8 path").to_string()
    }
}
