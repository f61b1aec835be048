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
