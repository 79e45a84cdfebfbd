{{/*
Names, labels and the values several templates derive alike.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "bellows.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name: fullnameOverride, or <release>-<chart> (just <release> when it
already contains the chart name). Cut to 40 characters, so that "<fullname>-worker-headless" and
the StatefulSet pod names stay within the 63 characters of a DNS label.
*/}}
{{- define "bellows.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* chart label: <name>-<version>. */}}
{{- define "bellows.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every resource carries. */}}
{{- define "bellows.labels" -}}
helm.sh/chart: {{ include "bellows.chart" . }}
{{ include "bellows.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: bellows
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels that select the release's pods (never change them: selectors are immutable). */}}
{{- define "bellows.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bellows.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component: (dict "ctx" $ "component" "router"). */}}
{{- define "bellows.componentLabels" -}}
{{ include "bellows.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Labels of a component's pods: no helm.sh/chart, so that a new chart version which changes nothing
in the pods does not restart them (a GPU worker reloads its model on every restart).
*/}}
{{- define "bellows.podLabels" -}}
{{ include "bellows.componentSelectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: bellows
{{- end }}

{{- define "bellows.componentSelectorLabels" -}}
{{ include "bellows.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The ServiceAccount the pods run as. */}}
{{- define "bellows.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "bellows.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* A Bellows image: (dict "ctx" $ "image" .Values.router.image "default" "bellows-router"). */}}
{{- define "bellows.image" -}}
{{- $repo := default .default .image.repository }}
{{- $tag := default (default .ctx.Chart.AppVersion .ctx.Values.image.tag) .image.tag }}
{{- if .ctx.Values.image.registry }}
{{- printf "%s/%s:%s" (trimSuffix "/" .ctx.Values.image.registry) $repo $tag }}
{{- else }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}
{{- end }}

{{/* A third-party image: {repository, tag}. */}}
{{- define "bellows.externalImage" -}}
{{- printf "%s:%s" .repository .tag }}
{{- end }}

{{- define "bellows.workerImage" -}}
{{- $default := ternary "bellows-worker-cuda" "bellows-worker-cpu" .Values.worker.gpu.enabled }}
{{- include "bellows.image" (dict "ctx" . "image" .Values.worker.image "default" $default) }}
{{- end }}

{{/* Service names. */}}
{{- define "bellows.router.fullname" -}}{{ include "bellows.fullname" . }}-router{{- end }}
{{- define "bellows.worker.fullname" -}}{{ include "bellows.fullname" . }}-worker{{- end }}
{{- define "bellows.etcd.fullname" -}}{{ include "bellows.fullname" . }}-etcd{{- end }}
{{- define "bellows.etcd.headless" -}}{{ include "bellows.fullname" . }}-etcd-headless{{- end }}
{{- define "bellows.jaeger.fullname" -}}{{ include "bellows.fullname" . }}-jaeger{{- end }}

{{/* <service>.<namespace>.svc.<clusterDomain> */}}
{{- define "bellows.svcDomain" -}}
{{- printf "%s.%s.svc.%s" .service .ctx.Release.Namespace .ctx.Values.clusterDomain }}
{{- end }}

{{/* The etcd client URLs both binaries use, comma separated (fails when there are none). */}}
{{- define "bellows.etcdEndpoints" -}}
{{- if .Values.etcd.enabled }}
{{- $domain := include "bellows.svcDomain" (dict "ctx" . "service" (include "bellows.etcd.headless" .)) }}
{{- $name := include "bellows.etcd.fullname" . }}
{{- $scheme := ternary "https" "http" .Values.tls.enabled }}
{{- $urls := list }}
{{- range $i := until (int .Values.etcd.replicas) }}
{{- $urls = append $urls (printf "%s://%s-%d.%s:2379" $scheme $name $i $domain) }}
{{- end }}
{{- join "," $urls }}
{{- else }}
{{- if not .Values.externalEtcd.endpoints }}
{{- fail "etcd.enabled is false: set externalEtcd.endpoints to the client URLs of your etcd (e.g. [http://etcd.example:2379])" }}
{{- end }}
{{- join "," .Values.externalEtcd.endpoints }}
{{- end }}
{{- end }}

{{/* The OTLP endpoint: otel.endpoint, else the bundled Jaeger, else "" (tracing off). */}}
{{- define "bellows.otelEndpoint" -}}
{{- if .Values.otel.endpoint }}
{{- .Values.otel.endpoint }}
{{- else if .Values.jaeger.enabled }}
{{- printf "http://%s:4317" (include "bellows.svcDomain" (dict "ctx" . "service" (include "bellows.jaeger.fullname" .))) }}
{{- end }}
{{- end }}

{{/*
Environment shared by both binaries: pod identity, logs, tracing.
(dict "ctx" $ "service" "bellows-router")
*/}}
{{- define "bellows.commonEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: BELLOWS_CLUSTER
  value: {{ .ctx.Values.cluster | quote }}
- name: BELLOWS_ETCD_ENDPOINTS
  value: {{ include "bellows.etcdEndpoints" .ctx | quote }}
- name: BELLOWS_LOG_FORMAT
  value: {{ .ctx.Values.log.format | quote }}
- name: RUST_LOG
  value: {{ .ctx.Values.log.level | quote }}
{{- $endpoint := include "bellows.otelEndpoint" .ctx }}
{{- if $endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: grpc
- name: OTEL_SERVICE_NAME
  value: {{ .service | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .ctx.Values.otel.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .ctx.Values.otel.samplerArg | quote }}
{{- $attrs := list "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.pod.name=$(POD_NAME)" "service.instance.id=$(POD_NAME)" }}
{{- range $k, $v := .ctx.Values.otel.resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%s" $k $v) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- end }}
{{- end }}

{{/* Container security context of the Bellows containers. */}}
{{- define "bellows.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/* Pod security context: uid/gid 10001 as in the images (docker/). */}}
{{- define "bellows.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Soft anti-affinity spreading a component's pods over nodes. */}}
{{- define "bellows.softAntiAffinity" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "bellows.componentSelectorLabels" . | nindent 12 }}
{{- end }}

{{/* Seconds a worker pod may take to stop: the preStop wait, the drain, a margin. */}}
{{- define "bellows.worker.terminationGracePeriodSeconds" -}}
{{- $w := .Values.worker }}
{{- add (int $w.preStopSleepSeconds) (int $w.drainTimeoutSeconds) (int $w.terminationGraceMarginSeconds) }}
{{- end }}

{{/* Full path of the model file the worker loads. */}}
{{- define "bellows.worker.modelPath" -}}
{{- $m := .Values.worker.model }}
{{- if and (eq $m.source "none") $m.path }}
{{- $m.path }}
{{- else }}
{{- printf "%s/%s" (trimSuffix "/" $m.mountPath) $m.file }}
{{- end }}
{{- end }}

{{/*
Name of a component's TLS Secret (router, worker, etcd; keys ca.crt, tls.crt, tls.key): the one
the chart or cert-manager makes, or yours (tls.source existing).
(dict "ctx" $ "component" "worker")
*/}}
{{- define "bellows.tlsSecret" -}}
{{- $tls := .ctx.Values.tls }}
{{- if eq $tls.source "existing" }}
{{- $name := get $tls.existingSecrets .component }}
{{- if not $name }}
{{- fail (printf "tls.source is existing: set tls.existingSecrets.%s (a Secret with ca.crt, tls.crt, tls.key)" .component) }}
{{- end }}
{{- $name }}
{{- else }}
{{- printf "%s-%s-tls" (include "bellows.fullname" .ctx) .component }}
{{- end }}
{{- end }}

{{/*
The names a component's certificate carries, as (dict "dns" list "ips" list). Workers: every pod
of the headless Service (routers accept a worker certificate naming the host it registered);
etcd: each member, the client Service, and localhost (etcd dials itself); routers: their name
(a router's certificate is only ever a client's).
(dict "ctx" $ "component" "worker")
*/}}
{{- define "bellows.tlsNames" -}}
{{- $ctx := .ctx }}
{{- if eq .component "worker" }}
{{- $headless := include "bellows.svcDomain" (dict "ctx" $ctx "service" (include "bellows.worker.fullname" $ctx)) }}
{{- dict "dns" (list (printf "*.%s" $headless)) "ips" list | toJson }}
{{- else if eq .component "etcd" }}
{{- $svc := include "bellows.etcd.fullname" $ctx }}
{{- $ns := $ctx.Release.Namespace }}
{{- $members := printf "*.%s" (include "bellows.svcDomain" (dict "ctx" $ctx "service" (include "bellows.etcd.headless" $ctx))) }}
{{- $dns := list $members $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (include "bellows.svcDomain" (dict "ctx" $ctx "service" $svc)) "localhost" }}
{{- dict "dns" $dns "ips" (list "127.0.0.1") | toJson }}
{{- else }}
{{- dict "dns" (list (include "bellows.router.fullname" $ctx)) "ips" list | toJson }}
{{- end }}
{{- end }}

{{/*
Environment for TLS and etcd credentials of a router or worker: its cluster certificate (mutual
TLS between routers and workers), and how it reaches etcd (the bundled etcd: the same certificate
as its client certificate; an external one: externalEtcd.tls and externalEtcd.auth).
*/}}
{{- define "bellows.securityEnv" -}}
{{- $v := .Values }}
{{- if $v.tls.enabled }}
- name: BELLOWS_TLS_CA
  value: /etc/bellows/tls/ca.crt
- name: BELLOWS_TLS_CERT
  value: /etc/bellows/tls/tls.crt
- name: BELLOWS_TLS_KEY
  value: /etc/bellows/tls/tls.key
{{- end }}
{{- if $v.etcd.enabled }}
{{- if $v.tls.enabled }}
- name: BELLOWS_ETCD_CA
  value: /etc/bellows/tls/ca.crt
- name: BELLOWS_ETCD_CERT
  value: /etc/bellows/tls/tls.crt
- name: BELLOWS_ETCD_KEY
  value: /etc/bellows/tls/tls.key
{{- end }}
{{- else }}
{{- $t := $v.externalEtcd.tls }}
{{- if $t.existingSecret }}
- name: BELLOWS_ETCD_CA
  value: /etc/bellows/etcd-tls/ca.crt
{{- if $t.clientCertificate }}
- name: BELLOWS_ETCD_CERT
  value: /etc/bellows/etcd-tls/tls.crt
- name: BELLOWS_ETCD_KEY
  value: /etc/bellows/etcd-tls/tls.key
{{- end }}
{{- end }}
{{- with $v.externalEtcd.auth }}
{{- if .username }}
- name: BELLOWS_ETCD_USER
  value: {{ .username | quote }}
- name: BELLOWS_ETCD_PASSWORD_FILE
  value: /etc/bellows/etcd-auth/{{ .passwordSecret.key }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Volume mounts matching bellows.securityEnv. */}}
{{- define "bellows.securityMounts" -}}
{{- $v := .Values }}
{{- if $v.tls.enabled }}
# The whole Secret as a directory (no subPath): a renewed certificate reaches the running
# process, which takes it for new connections.
- name: tls
  mountPath: /etc/bellows/tls
  readOnly: true
{{- end }}
{{- if not $v.etcd.enabled }}
{{- if $v.externalEtcd.tls.existingSecret }}
- name: etcd-tls
  mountPath: /etc/bellows/etcd-tls
  readOnly: true
{{- end }}
{{- if $v.externalEtcd.auth.username }}
- name: etcd-auth
  mountPath: /etc/bellows/etcd-auth
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{/* Volumes matching bellows.securityMounts. (dict "ctx" $ "component" "router") */}}
{{- define "bellows.securityVolumes" -}}
{{- $v := .ctx.Values }}
{{- if $v.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "bellows.tlsSecret" . }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- if not $v.etcd.enabled }}
{{- with $v.externalEtcd.tls.existingSecret }}
- name: etcd-tls
  secret:
    secretName: {{ . }}
{{- end }}
{{- with $v.externalEtcd.auth }}
{{- if .username }}
{{- if not .passwordSecret.name }}
{{- fail "externalEtcd.auth.username is set: set externalEtcd.auth.passwordSecret.name (a Secret holding the password)" }}
{{- end }}
- name: etcd-auth
  secret:
    secretName: {{ .passwordSecret.name }}
    items:
      - {key: {{ .passwordSecret.key }}, path: {{ .passwordSecret.key }}}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
