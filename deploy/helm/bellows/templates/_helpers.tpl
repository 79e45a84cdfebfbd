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
{{- $urls := list }}
{{- range $i := until (int .Values.etcd.replicas) }}
{{- $urls = append $urls (printf "http://%s-%d.%s:2379" $name $i $domain) }}
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
