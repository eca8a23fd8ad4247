//! The console's guards on actions: the operator token (compared in constant time) and a
//! signed double-submit CSRF token.
//!
//! CSRF: a page with an action form sets the cookie [`CSRF_COOKIE`] (`HttpOnly`,
//! `SameSite=Strict`) and puts the same token in the form. A token is a random nonce with its
//! HMAC-SHA256 under a key drawn when the process starts, so a token that this process did not
//! mint is refused even when cookie and form agree (a cookie planted by a sibling subdomain),
//! and tokens die with the process. A POST passes only with both, equal and valid; a browser
//! request that says it comes from another origin (`Origin`, `Sec-Fetch-Site`) is refused too.

use axum::http::{header, HeaderMap};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The CSRF cookie's name.
pub const CSRF_COOKIE: &str = "outbox_console_csrf";

const NONCE: usize = 16;
const MAC: usize = 32;

/// Mints and checks CSRF tokens with a key of this process.
#[derive(Clone)]
pub struct Csrf {
    key: [u8; 32],
}

impl std::fmt::Debug for Csrf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Csrf(***)")
    }
}

impl Default for Csrf {
    fn default() -> Self {
        let mut key = [0u8; 32];
        rand::rng().fill_bytes(&mut key);
        Self { key }
    }
}

impl Csrf {
    fn mac(&self, nonce: &[u8]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes any key");
        mac.update(b"outbox-console-csrf");
        mac.update(nonce);
        mac
    }

    /// A fresh token.
    pub fn mint(&self) -> String {
        let mut token = [0u8; NONCE + MAC];
        rand::rng().fill_bytes(&mut token[..NONCE]);
        let mac = self.mac(&token[..NONCE]).finalize().into_bytes();
        token[NONCE..].copy_from_slice(&mac);
        URL_SAFE_NO_PAD.encode(token)
    }

    /// Whether this process minted `token`.
    pub fn is_valid(&self, token: &str) -> bool {
        let Ok(bytes) = URL_SAFE_NO_PAD.decode(token.trim()) else {
            return false;
        };
        if bytes.len() != NONCE + MAC {
            return false;
        }
        self.mac(&bytes[..NONCE])
            .verify_slice(&bytes[NONCE..])
            .is_ok()
    }

    /// The request's cookie token when it is valid (reused by the next form), else a fresh one
    /// with the `Set-Cookie` value that installs it.
    pub fn for_form(&self, headers: &HeaderMap) -> (String, Option<String>) {
        if let Some(t) = cookie(headers, CSRF_COOKIE).filter(|t| self.is_valid(t)) {
            return (t, None);
        }
        let t = self.mint();
        let set = format!("{CSRF_COOKIE}={t}; Path=/console; HttpOnly; SameSite=Strict");
        (t, Some(set))
    }

    /// Whether a POST carries a valid token in both its cookie and its form, the same one.
    pub fn check(&self, headers: &HeaderMap, form: Option<&str>) -> bool {
        let (Some(cookie), Some(form)) = (cookie(headers, CSRF_COOKIE), form) else {
            return false;
        };
        self.is_valid(&cookie)
            && self.is_valid(form)
            && bool::from(cookie.as_bytes().ct_eq(form.trim().as_bytes()))
    }
}

/// Whether a browser says the request comes from another site: `Sec-Fetch-Site: cross-site`
/// (or `same-site`), or an `Origin` whose host is not the `Host` asked for.
pub fn cross_origin(headers: &HeaderMap) -> bool {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if matches!(get("sec-fetch-site"), Some("cross-site" | "same-site")) {
        return true;
    }
    match (get(header::ORIGIN.as_str()), get(header::HOST.as_str())) {
        (Some("null"), _) => true,
        (Some(origin), Some(host)) => {
            let origin_host = origin.split_once("://").map_or(origin, |(_, h)| h);
            !origin_host.eq_ignore_ascii_case(host)
        }
        _ => false,
    }
}

/// Whether `given` is the operator token `expected`, in time that does not depend on where
/// they differ (both are hashed first, so not on their lengths either). An empty `expected`
/// never matches.
pub fn token_matches(expected: &str, given: &str) -> bool {
    if expected.is_empty() {
        return false;
    }
    let a = Sha256::digest(expected.as_bytes());
    let b = Sha256::digest(given.as_bytes());
    bool::from(a.ct_eq(&b))
}

/// The value of cookie `name` in the request.
pub fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn with_cookie(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::COOKIE, HeaderValue::from_str(v).unwrap());
        h
    }

    #[test]
    fn tokens_of_this_process_pass_only_in_cookie_and_form_alike() {
        let csrf = Csrf::default();
        let t = csrf.mint();
        assert!(csrf.is_valid(&t));
        let h = with_cookie(&format!("a=b; {CSRF_COOKIE}={t}"));
        assert!(csrf.check(&h, Some(&t)));
        // Missing on either side.
        assert!(!csrf.check(&h, None));
        assert!(!csrf.check(&HeaderMap::new(), Some(&t)));
        // Two valid tokens that differ.
        assert!(!csrf.check(&h, Some(&csrf.mint())));
        // Another process's token, in cookie and form alike.
        let other = Csrf::default().mint();
        let h = with_cookie(&format!("{CSRF_COOKIE}={other}"));
        assert!(!csrf.check(&h, Some(&other)));
        // Tampered.
        let mut bad = t.clone();
        bad.replace_range(0..1, if t.starts_with('A') { "B" } else { "A" });
        assert!(!csrf.is_valid(&bad));
        assert!(!csrf.is_valid("not base64 !"));
    }

    #[test]
    fn a_valid_cookie_is_reused_and_a_bad_one_replaced() {
        let csrf = Csrf::default();
        let t = csrf.mint();
        let (same, set) = csrf.for_form(&with_cookie(&format!("{CSRF_COOKIE}={t}")));
        assert_eq!((same, set), (t, None));
        let (fresh, set) = csrf.for_form(&with_cookie(&format!("{CSRF_COOKIE}=forged")));
        assert!(csrf.is_valid(&fresh));
        let set = set.expect("a cookie is set");
        assert!(
            set.contains("HttpOnly") && set.contains("SameSite=Strict"),
            "{set}"
        );
    }

    #[test]
    fn the_operator_token_must_match_exactly_and_never_when_unset() {
        assert!(token_matches("s3cret", "s3cret"));
        assert!(!token_matches("s3cret", "s3cre"));
        assert!(!token_matches("s3cret", "s3cret "));
        assert!(!token_matches("", ""));
    }

    #[test]
    fn other_origins_are_told_apart() {
        let h = |pairs: &[(&'static str, &'static str)]| {
            let mut m = HeaderMap::new();
            for (k, v) in pairs {
                m.insert(*k, HeaderValue::from_static(v));
            }
            m
        };
        assert!(!cross_origin(&h(&[("host", "127.0.0.1:9465")])));
        assert!(!cross_origin(&h(&[
            ("host", "127.0.0.1:9465"),
            ("origin", "http://127.0.0.1:9465")
        ])));
        assert!(cross_origin(&h(&[
            ("host", "127.0.0.1:9465"),
            ("origin", "http://evil.example")
        ])));
        assert!(cross_origin(&h(&[("sec-fetch-site", "cross-site")])));
        assert!(cross_origin(&h(&[("origin", "null")])));
    }
}
