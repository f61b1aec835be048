{{/* Names: <release>-torchvitals, cut to the 63 characters a DNS label allows. */}}
{{- define "torchvitals.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "torchvitals.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "torchvitals.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "torchvitals.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "torchvitals.collector.selectorLabels" -}}
app.kubernetes.io/name: {{ include "torchvitals.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: collector
{{- end -}}

{{- define "torchvitals.collector.fullname" -}}
{{- printf "%s-collector" (include "torchvitals.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* In-cluster base URL of the collector. */}}
{{- define "torchvitals.collector.url" -}}
{{- printf "http://%s.%s.svc:%d" (include "torchvitals.collector.fullname" .) .Release.Namespace (int .Values.collector.service.port) -}}
{{- end -}}

{{/* The Secret holding the webhook token: the existing one, or the chart's. */}}
{{- define "torchvitals.tokenSecret" -}}
{{- if .Values.webhookToken.existingSecret -}}
{{- .Values.webhookToken.existingSecret -}}
{{- else -}}
{{- printf "%s-webhook-token" (include "torchvitals.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "torchvitals.image" -}}
{{- printf "%s:%s" .image.repository (default .chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* Prometheus matchers: the configured ones, parsed into name / matchType / value. */}}
{{- define "torchvitals.matchers" -}}
{{- range .Values.alertmanager.matchers }}
{{- $m := regexFind "^[a-zA-Z_][a-zA-Z0-9_]*(=~|!~|!=|=)" . }}
{{- $op := regexFind "(=~|!~|!=|=)$" $m }}
- name: {{ trimSuffix $op $m }}
  matchType: {{ quote $op }}
  value: {{ trimPrefix $m . | trimPrefix "\"" | trimSuffix "\"" | quote }}
{{- end }}
{{- end -}}

{{- define "torchvitals.exampleJob.name" -}}
{{- printf "%s-example" (include "torchvitals.fullname" .) | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- /* The Secret of the job tokens: the given one; else the chart's token Secret; else, when the
webhook token's Secret is not the chart's, one of the chart's own. */}}
{{- define "torchvitals.jobTokenSecret" -}}
{{- if .Values.jobTokens.existingSecret -}}
{{- .Values.jobTokens.existingSecret -}}
{{- else if .Values.webhookToken.existingSecret -}}
{{- printf "%s-job-tokens" (include "torchvitals.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- include "torchvitals.tokenSecret" . -}}
{{- end -}}
{{- end -}}

{{- /* The Secret key of a job's own token (the argument: the job's name). */}}
{{- define "torchvitals.jobTokenKey" -}}
{{- printf "job-%s" . -}}
{{- end -}}

{{- /* The `data:` entries of the job tokens the chart makes: one `job-<name>` per job (kept on
upgrades, as the webhook token is) and `job-tokens.json`, the collector's job -> sha256 digest,
so the collector's copy holds nothing a job could use. */}}
{{- define "torchvitals.jobTokenData" -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "torchvitals.jobTokenSecret" .) -}}
{{- $jobs := .Values.jobTokens.jobs -}}
{{- if .Values.exampleJob.enabled -}}
{{- $jobs = append $jobs (include "torchvitals.exampleJob.name" .) -}}
{{- end -}}
{{- $digests := dict -}}
{{- range $job := $jobs | uniq }}
{{- $key := include "torchvitals.jobTokenKey" $job }}
{{- $token := randAlphaNum 48 }}
{{- if and $existing $existing.data (hasKey $existing.data $key) }}
{{- $token = index $existing.data $key | b64dec }}
{{- end }}
{{- $_ := set $digests $job (printf "sha256:%s" (sha256sum $token)) }}
{{ $key }}: {{ $token | b64enc | quote }}
{{- end }}
job-tokens.json: {{ $digests | toJson | b64enc | quote }}
{{- end -}}

{{- /* The chart's etcd: its name, and whether it is rendered ("true" or ""): only for a multi-node
example job that brings no store of its own. */}}
{{- define "torchvitals.etcd.fullname" -}}
{{- printf "%s-etcd" (include "torchvitals.fullname" .) | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "torchvitals.etcd.rendered" -}}
{{- $j := .Values.exampleJob -}}
{{- if and $j.enabled (gt (int $j.nodes) 1) (not $j.supervisor.storeUrl) .Values.etcd.enabled -}}
true
{{- end -}}
{{- end -}}

{{- define "torchvitals.etcd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "torchvitals.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: etcd
{{- end -}}

{{- /* The store URL every supervisor of the example job gets: the given one, else the chart's
etcd's client Service, else "" (one node: no store). */}}
{{- define "torchvitals.storeUrl" -}}
{{- if .Values.exampleJob.supervisor.storeUrl -}}
{{- .Values.exampleJob.supervisor.storeUrl -}}
{{- else if include "torchvitals.etcd.rendered" . -}}
{{- printf "%s://%s.%s.svc:2379" (ternary "https" "http" .Values.etcd.tls.enabled) (include "torchvitals.etcd.fullname" .) .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{- /* The names of the ranks' metrics ports, <portPrefix>0 .. <portPrefix><ranksPerPod - 1>, as
a JSON list. */}}
{{- define "torchvitals.rankPorts" -}}
{{- $ports := list -}}
{{- range $rank := until (int .Values.scraping.ranksPerPod) -}}
{{- $ports = append $ports (printf "%s%d" $.Values.scraping.portPrefix $rank) -}}
{{- end -}}
{{- toJson $ports -}}
{{- end -}}
