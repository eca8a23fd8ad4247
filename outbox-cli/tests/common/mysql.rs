//! A fresh MariaDB / MySQL database per test on the server of `MYSQL_URL`, and the `outbox`
//! binary run against it in an empty directory, as a user runs it with a `mysql://` URL.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use outbox_mysql::sqlx::{self, mysql::MySqlPoolOptions, MySqlPool};

/// One test's database.
pub struct Db {
    /// A pool on the server (not on the test's database).
    pub admin: MySqlPool,
    /// The database's name.
    pub name: String,
    /// `MYSQL_URL`.
    pub base: String,
    /// The directory the binary runs in (an `outbox.toml` there is its configuration).
    pub dir: PathBuf,
}

impl Db {
    /// A fresh database, or `None` when the server is missing and skipping is allowed.
    pub async fn new(test: &str) -> Option<Self> {
        let base = outbox_test_support::mysql_url(test)?;
        let admin = MySqlPoolOptions::new()
            .max_connections(2)
            .connect(&base)
            .await
            .expect("MariaDB answers at MYSQL_URL");
        let name = outbox_test_support::unique("ocli");
        sqlx::query(&format!("CREATE DATABASE `{name}`"))
            .execute(&admin)
            .await
            .expect("create database");
        let dir = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(&dir).expect("temp dir");
        Some(Self {
            admin,
            name,
            base,
            dir,
        })
    }

    /// The server's URL with this database as its path.
    pub fn url(&self) -> String {
        let (head, tail) = self.base.split_once("://").expect("MYSQL_URL has a scheme");
        let host = tail.split(['/', '?']).next().unwrap_or(tail);
        format!("{head}://{host}/{}", self.name)
    }

    /// A pool on this database.
    pub async fn pool(&self) -> MySqlPool {
        MySqlPoolOptions::new()
            .max_connections(4)
            .connect(&self.url())
            .await
            .expect("connect")
    }

    /// `outbox <args>` with `DATABASE_URL` = `url`, in [`dir`](Self::dir), no broker.
    /// `OUTBOX_TEST_BIN` names another build of the binary to run instead (e.g. an earlier
    /// commit's, to see a new test fail against it).
    pub fn command(&self, url: &str, envs: &[(&str, &str)], args: &[&str]) -> Command {
        let bin = std::env::var("OUTBOX_TEST_BIN")
            .ok()
            .filter(|b| !b.trim().is_empty())
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_outbox").to_owned());
        let mut c = Command::new(bin);
        c.current_dir(&self.dir)
            .env_remove("RUST_LOG")
            .env_remove("OUTBOX_CONFIG")
            .env_remove("KAFKA_BROKERS")
            .env_remove("OUTBOX_OUTBOX__SCHEMA")
            .env_remove("OUTBOX_ACTOR")
            .env("DATABASE_URL", url)
            .envs(envs.iter().copied())
            .args(args)
            .stdin(Stdio::null());
        c
    }

    /// Runs [`command`](Self::command) to completion.
    pub fn outbox(&self, url: &str, envs: &[(&str, &str)], args: &[&str]) -> Output {
        self.command(url, envs, args).output().expect("run outbox")
    }

    /// Drops the database and the directory.
    pub async fn drop(self) {
        let _ = sqlx::query(&format!("DROP DATABASE `{}`", self.name))
            .execute(&self.admin)
            .await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
