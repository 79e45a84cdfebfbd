//! The metrics as Prometheus itself reads them: a real Prometheus server (Debian's `prometheus`,
//! installed by scripts/install-deps.sh) scrapes a real router and worker, and every PromQL query
//! the Helm chart's KEDA ScaledObject renders, for each `worker.autoscaling.keda.waitingPriority`,
//! must return a number. A query naming a metric that no longer exists, or a label the scrape does
//! not carry, returns an empty vector: KEDA would then scale on nothing, silently. And `promtool
//! check metrics` lints both scrapes (a gauge named `_total`, a counter without it, missing help).
//!
//! Tools: `prometheus` and `promtool` from `BELLOWS_PROMETHEUS` / `BELLOWS_PROMTOOL` or PATH;
//! helm from `BELLOWS_HELM`, scripts/check-deploy.sh's cache (`BELLOWS_DEPLOY_TOOLS`, default
//! `~/.cache/bellows/deploy-tools`), or PATH. A missing tool fails the test, naming the script
//! that installs it: a skip would hide exactly the breakage this test is for.

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use bellows_integration::{Process, Router, Worker, eventually, free_port, sim};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::sync::oneshot;

/// The release and namespace the chart is rendered as; the scrape of the router carries the
/// `namespace` and `service` labels a ServiceMonitor's scrape would (taken from the rendered
/// router Service, not assumed).
const RELEASE: &str = "bellows";
const NAMESPACE: &str = "bellows-test";

fn chart() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/helm/bellows")
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(name)).find(|p| p.is_file())
}

/// `env` if set, else the first of `candidates` that exists, else `name` on PATH.
fn tool(env: &str, candidates: &[PathBuf], name: &str, installs: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .or_else(|| on_path(name))
        .unwrap_or_else(|| panic!("{name} not found (set {env}, or run {installs}, which installs it)"))
}

fn helm() -> PathBuf {
    let cache = std::env::var_os("BELLOWS_DEPLOY_TOOLS")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/bellows/deploy-tools")));
    let candidates: Vec<PathBuf> = cache.into_iter().map(|d| d.join("bin/helm")).collect();
    tool("BELLOWS_HELM", &candidates, "helm", "scripts/check-deploy.sh")
}

fn prometheus() -> PathBuf {
    tool("BELLOWS_PROMETHEUS", &[], "prometheus", "scripts/install-deps.sh")
}

fn promtool() -> PathBuf {
    tool("BELLOWS_PROMTOOL", &[], "promtool", "scripts/install-deps.sh")
}

/// `helm template` of the chart with these `--set` values: every manifest, parsed.
fn render(set: &[&str]) -> Vec<Value> {
    let mut cmd = Command::new(helm());
    cmd.args(["template", RELEASE]).arg(chart()).args(["--namespace", NAMESPACE]);
    for s in set {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().expect("helm runs");
    assert!(out.status.success(), "helm template {set:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).expect("helm prints UTF-8");
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).expect("helm renders YAML"))
        .filter(|doc| !doc.is_null())
        .collect()
}

/// Every Prometheus trigger's query in the rendered ScaledObjects, as (trigger name, query).
fn keda_queries(manifests: &[Value]) -> Vec<(String, String)> {
    let scaled: Vec<&Value> = manifests.iter().filter(|m| m["kind"] == "ScaledObject").collect();
    assert!(!scaled.is_empty(), "the chart rendered no ScaledObject with KEDA enabled");
    let mut queries = Vec::new();
    for so in scaled {
        let triggers = so["spec"]["triggers"].as_array().expect("a ScaledObject has triggers");
        for t in triggers.iter().filter(|t| t["type"] == "prometheus") {
            let query = t["metadata"]["query"].as_str().expect("a prometheus trigger has a query");
            queries.push((t["name"].as_str().unwrap_or("?").to_string(), query.to_string()));
        }
    }
    assert!(!queries.is_empty(), "the ScaledObjects have no prometheus trigger");
    queries
}

/// The waitingPriority values the chart accepts, from its schema (so a class added there is
/// tested here without editing this file).
fn waiting_priorities() -> Vec<String> {
    let schema: Value =
        serde_json::from_str(&std::fs::read_to_string(chart().join("values.schema.json")).unwrap()).unwrap();
    let keda = &schema["properties"]["worker"]["properties"]["autoscaling"]["properties"]["keda"]["properties"];
    let values: Vec<String> = keda["waitingPriority"]["enum"]
        .as_array()
        .expect("values.schema.json lists worker.autoscaling.keda.waitingPriority's values")
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    assert!(values.iter().any(|v| v == "batch"), "{values:?}");
    values
}

/// A Prometheus server with its own config and data dir, on a free loopback port.
struct Prometheus {
    _process: Process,
    url: String,
    _dir: TempDir,
}

impl Prometheus {
    /// Start one scraping these jobs (name, target, extra target labels), and wait until ready.
    async fn start(jobs: &[(&str, &str, Value)]) -> Prometheus {
        let dir = TempDir::new().unwrap();
        // JSON is YAML: the config is written as JSON so that no value needs YAML quoting.
        let scrape_configs: Vec<Value> = jobs
            .iter()
            .map(|(job, target, labels)| {
                json!({"job_name": job, "scrape_interval": "250ms", "scrape_timeout": "250ms",
                       "static_configs": [{"targets": [target], "labels": labels}]})
            })
            .collect();
        let config = dir.path().join("prometheus.yml");
        let body = json!({"global": {"scrape_interval": "250ms", "scrape_timeout": "250ms"},
                          "scrape_configs": scrape_configs});
        std::fs::write(&config, body.to_string()).unwrap();
        for attempt in 1..=3 {
            let addr = format!("127.0.0.1:{}", free_port());
            let args = vec![
                format!("--config.file={}", config.display()),
                format!("--storage.tsdb.path={}", dir.path().join(format!("data-{attempt}")).display()),
                format!("--web.listen-address={addr}"),
            ];
            let mut process = Process::spawn("prometheus", prometheus(), args, addr.clone(), &[]);
            let url = format!("http://{addr}");
            let deadline = Instant::now() + Duration::from_secs(60);
            while !process.exited() {
                if reqwest::get(format!("{url}/-/ready")).await.is_ok_and(|r| r.status().is_success()) {
                    return Prometheus { _process: process, url, _dir: dir };
                }
                assert!(Instant::now() < deadline, "Prometheus not ready after 60 s; log:\n{}", process.log());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let lost_port = process.log().contains("address already in use");
            assert!(lost_port && attempt < 3, "Prometheus exited; log:\n{}", process.log());
        }
        unreachable!("the last attempt returns or fails")
    }

    /// `/api/v1/query` at the current time: the `data` object, or the error Prometheus gave.
    async fn query(&self, query: &str) -> Result<Value, String> {
        let r = reqwest::Client::new()
            .get(format!("{}/api/v1/query", self.url))
            .query(&[("query", query)])
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let body: Value = r.json().await.map_err(|e| e.to_string())?;
        if body["status"] != "success" {
            return Err(format!("{}: {}", body["errorType"], body["error"]));
        }
        Ok(body["data"].clone())
    }

    /// The query's value: a one-sample vector or a scalar. An empty vector, several samples, an
    /// error or a value that is not a finite number is an `Err` saying which.
    async fn number(&self, query: &str) -> Result<f64, String> {
        let data = self.query(query).await?;
        let value = match data["resultType"].as_str() {
            Some("scalar") => &data["result"][1],
            Some("vector") => match data["result"].as_array().map(Vec::as_slice) {
                Some([one]) => &one["value"][1],
                Some([]) => return Err("an empty vector: the query matches no series".into()),
                _ => return Err(format!("{} samples where one was expected: {data}", data["result"])),
            },
            _ => return Err(format!("a {} where a number was expected: {data}", data["resultType"])),
        };
        let v: f64 = value.as_str().and_then(|s| s.parse().ok()).ok_or(format!("not a number: {value}"))?;
        if v.is_finite() { Ok(v) } else { Err(format!("{v}: not a finite number")) }
    }

    /// Wait until every job's target has been scraped successfully: `up` is 1 for each. `up` is
    /// written with the scrape's own samples, so once it reads 1 those samples are queryable.
    async fn wait_up(&self, jobs: &[&str]) {
        let what = format!("Prometheus scraped {jobs:?} successfully (up == 1)");
        eventually(&what, Duration::from_secs(60), || async {
            for job in jobs {
                if self.number(&format!("up{{job=\"{job}\"}}")).await.ok()? != 1.0 {
                    return None;
                }
            }
            Some(())
        })
        .await;
    }
}

/// A worker on the simulated engine (these sim settings and extra flags) with its metrics on a
/// port of its own, and a router in front of it that has answered one request (so the
/// per-model and per-request series exist).
async fn cluster(sim_config: &str, flags: &[&str]) -> (Worker, Router, String) {
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut args = sim(sim_config);
    args.extend(["--metrics-listen".to_string(), metrics.clone()]);
    args.extend(flags.iter().map(|f| f.to_string()));
    let worker = Worker::start(&args).await;
    let router = Router::with_workers(&[&worker], &[] as &[&str]).await;
    let choices = router
        .choices("/v1/completions", &json!({"model": "sim", "prompt": "x", "max_tokens": 4, "ignore_eos": true}))
        .await;
    assert_eq!(choices[0].1, "length", "{choices:?}");
    (worker, router, metrics)
}

/// Stream a long completion in this OpenAI service tier, in the background (aborted when the
/// test ends; the router then cancels it at the worker). The receiver fires at its first token.
fn send(router: &Router, tier: &str, i: u32) -> (tokio::task::JoinHandle<()>, oneshot::Receiver<()>) {
    let url = router.url("/v1/completions");
    let body = json!({"model": "sim", "prompt": [1 + i, 2, 3], "max_tokens": 4000, "ignore_eos": true,
                      "stream": true, "service_tier": tier});
    let (first, rx) = oneshot::channel();
    let task = tokio::spawn(async move {
        let response = reqwest::Client::new().post(url).json(&body).send().await.expect("the router answers");
        assert_eq!(response.status(), 200);
        let mut body = response.bytes_stream();
        let mut buf = String::new();
        let mut first = Some(first);
        while let Some(Ok(chunk)) = body.next().await {
            buf.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = buf.find("\n\n") {
                let event: String = buf.drain(..end + 2).collect();
                let data = event.lines().filter_map(|l| l.strip_prefix("data: "));
                let text = data.filter_map(|d| serde_json::from_str::<Value>(d).ok()).any(|e| {
                    e["choices"]
                        .as_array()
                        .is_some_and(|c| c.iter().any(|c| c["text"].as_str().is_some_and(|t| !t.is_empty())))
                });
                if text && let Some(tx) = first.take() {
                    let _ = tx.send(());
                }
            }
        }
    });
    (task, rx)
}

/// A streamed request's first token, within 30 s.
async fn first_token(rx: oneshot::Receiver<()>) {
    tokio::time::timeout(Duration::from_secs(30), rx)
        .await
        .expect("the running request streams its first token within 30 s")
        .expect("the request's stream is still open");
}

/// Wait until the worker reports exactly this many running and waiting requests.
async fn wait_load(worker: &Worker, running: u32, waiting: u32) {
    let what = format!("the worker to run {running} and queue {waiting} requests");
    eventually(&what, Duration::from_secs(30), || async {
        let load = worker.load().await;
        (load.running_requests == running && load.waiting_requests == waiting).then_some(())
    })
    .await;
}

/// The name and namespace of the rendered router Service: what a ServiceMonitor scrape labels
/// the router's series with (`service`, `namespace`), and what the ScaledObject's queries select.
fn router_service(manifests: &[Value]) -> (String, String) {
    let svc = manifests
        .iter()
        .find(|m| m["kind"] == "Service" && m["spec"]["selector"]["app.kubernetes.io/component"] == "router")
        .expect("the chart renders a router Service");
    let name = svc["metadata"]["name"].as_str().unwrap().to_string();
    let namespace = svc["metadata"]["namespace"].as_str().unwrap_or(NAMESPACE).to_string();
    (name, namespace)
}

/// Every query each waitingPriority renders returns a number, idle and under a backlog; and
/// under the backlog the demand trigger counts the classes it names: running sequences (any
/// class) plus the waiting work of that class and those above it.
#[tokio::test]
async fn every_query_of_the_charts_keda_scaledobject_returns_a_number_from_a_real_prometheus() {
    // 20 ms a step and two slots, of which batch may fill one: the rest queue at the worker.
    let (worker, router, worker_metrics) = cluster(r#"{"base_us": 20000}"#, &["--max-running", "2"]).await;
    let keda = "worker.autoscaling.keda.enabled=true";
    let default_render = render(&[keda]);
    let (service, namespace) = router_service(&default_render);
    let router_addr = router.url.trim_start_matches("http://").to_string();
    let prom = Prometheus::start(&[
        ("router", &router_addr, json!({"namespace": namespace, "service": service})),
        ("worker", &worker_metrics, json!({"namespace": namespace})),
    ])
    .await;
    prom.wait_up(&["router", "worker"]).await;

    let mut renders = vec![("default".to_string(), keda_queries(&default_render))];
    for p in waiting_priorities() {
        let set = format!("worker.autoscaling.keda.waitingPriority={p}");
        renders.push((p, keda_queries(&render(&[keda, &set]))));
    }
    // The default is batch, and batch is the queries the chart always had: behaviour unchanged.
    let batch = &renders.iter().find(|(p, _)| p == "batch").expect("batch is rendered").1;
    assert_eq!(&renders[0].1, batch, "the default waitingPriority must render batch's queries");
    // The classes above batch read the by-priority gauges (else the value would change nothing).
    for (p, queries) in renders.iter().filter(|(p, _)| p != "batch" && p != "default") {
        assert!(queries.iter().any(|(_, q)| q.contains("_by_priority")), "waitingPriority={p}: {queries:?}");
    }
    let evaluate = |state: &'static str| {
        let (prom, renders) = (&prom, &renders);
        async move {
            let mut values = Vec::new();
            let mut failures = Vec::new();
            for (priority, queries) in renders {
                for (trigger, query) in queries {
                    match prom.number(query).await {
                        Ok(v) => {
                            eprintln!("{state}: waitingPriority={priority} {trigger}: {v} <- {query}");
                            values.push((priority.clone(), trigger.clone(), v));
                        }
                        Err(e) => failures
                            .push(format!("{state}: waitingPriority={priority}, trigger {trigger}: {e}\n    {query}")),
                    }
                }
            }
            assert!(failures.is_empty(), "KEDA queries that return no number:\n{}", failures.join("\n"));
            assert!(values.len() >= 2 * renders.len(), "{} queries over {} renders", values.len(), renders.len());
            values
        }
    };
    evaluate("idle").await;

    // A backlog in every class: one batch request runs and three wait; a standard one takes the
    // slot batch leaves free and another waits; an interactive one waits ahead of them all. Each
    // running request has streamed a token before the next arrives: only a request that has
    // produced none may be preempted, and a preemption would move the counts.
    let mut sent = Vec::new();
    let (task, running_batch) = send(&router, "flex", 0);
    sent.push(task);
    wait_load(&worker, 1, 0).await;
    first_token(running_batch).await;
    sent.extend((1..4).map(|i| send(&router, "flex", i).0));
    wait_load(&worker, 1, 3).await;
    let (task, running_standard) = send(&router, "default", 4);
    sent.push(task);
    wait_load(&worker, 2, 3).await;
    first_token(running_standard).await;
    sent.push(send(&router, "default", 5).0);
    wait_load(&worker, 2, 4).await;
    sent.push(send(&router, "priority", 6).0);
    wait_load(&worker, 2, 5).await;
    // Until a scrape shows it: the total and the interactive class's queue, as the queries read.
    let sel = format!("namespace=\"{namespace}\",service=\"{service}\"");
    eventually("Prometheus to see the backlog", Duration::from_secs(30), || async {
        let total = prom.number(&format!("max(bellows_router_cluster_waiting_requests{{{sel}}})")).await.ok()?;
        let q = format!("sum(bellows_router_cluster_waiting_requests_by_priority{{{sel},priority=\"interactive\"}})");
        let interactive = prom.number(&q).await.ok()?;
        (total == 5.0 && interactive == 1.0).then_some(())
    })
    .await;
    let values = evaluate("backlog").await;
    // Running: 2. Waiting: interactive 1, standard 1, batch 3.
    for (priority, want) in [("default", 7.0), ("batch", 7.0), ("standard", 4.0), ("interactive", 3.0)] {
        let demand = values.iter().find(|(p, t, _)| p == priority && t == "demand").map(|v| v.2);
        assert_eq!(demand, Some(want), "waitingPriority={priority}: the demand trigger");
    }
    for (priority, trigger, v) in &values {
        if trigger == "backlog" {
            assert!(*v > 0.0, "waitingPriority={priority}: the backlog trigger reads no waiting tokens");
        }
    }
    sent.iter().for_each(|t| t.abort());
}

/// OpenMetrics text (what both servers send) as the Prometheus text format that `promtool
/// check metrics` parses: a counter family `x` is exposed as samples `x_total`, which the text
/// format names `x_total` in HELP and TYPE; `# EOF` and `# UNIT` have no text-format equivalent.
/// Nothing else changes, so every name promtool sees is the name a scrape stores.
fn openmetrics_to_text(om: &str) -> String {
    let counters: std::collections::HashSet<&str> =
        om.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::new();
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            counters.contains(name).then(|| format!("{p}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// `promtool check metrics` on a scrape: its report (empty when it found nothing).
fn promtool_check(text: &str) -> (bool, String) {
    let mut child = Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool runs");
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), report.trim().to_string())
}

#[test]
fn openmetrics_counters_become_text_format_families_and_nothing_else_changes() {
    let om = "# HELP a_tokens Tokens.\n# TYPE a_tokens counter\na_tokens_total 3\n\
              # HELP a_blocks_total Blocks.\n# TYPE a_blocks_total gauge\na_blocks_total 1\n# EOF\n";
    let text = openmetrics_to_text(om);
    assert_eq!(
        text,
        "# HELP a_tokens_total Tokens.\n# TYPE a_tokens_total counter\na_tokens_total 3\n\
         # HELP a_blocks_total Blocks.\n# TYPE a_blocks_total gauge\na_blocks_total 1\n"
    );
    // And promtool, given it, still catches a gauge named like a counter.
    let (ok, report) = promtool_check(&text);
    assert!(!ok && report.contains("a_blocks_total non-counter metrics should not have \"_total\" suffix"), "{report}");
}

#[tokio::test]
async fn the_router_and_worker_scrapes_pass_promtool_check_metrics() {
    let (_worker, router, worker_metrics) = cluster("{}", &[]).await;
    for (who, url) in [("router", router.url("/metrics")), ("worker", format!("http://{worker_metrics}/metrics"))] {
        let scrape = reqwest::get(&url).await.unwrap().text().await.unwrap();
        assert!(scrape.contains(&format!("bellows_{who}_")), "{who}'s scrape has no bellows_{who}_ metric:\n{scrape}");
        let (ok, report) = promtool_check(&openmetrics_to_text(&scrape));
        assert!(ok && report.is_empty(), "promtool check metrics on the {who}'s /metrics:\n{report}");
    }
}
