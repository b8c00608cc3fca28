{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "packtrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Object-name prefix: the release name, qualified by the chart name unless it already has it. */}}
{{- define "packtrain.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "packtrain.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object carries. */}}
{{- define "packtrain.labels" -}}
helm.sh/chart: {{ include "packtrain.chart" . }}
{{ include "packtrain.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: packtrain
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels selecting the operator pod; immutable in a Deployment, so no version here. */}}
{{- define "packtrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "packtrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "packtrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "packtrain.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* "repository:tag", the tag defaulting to the chart's appVersion. Call with (list $image $). */}}
{{- define "packtrain.image" -}}
{{- $image := index . 0 }}
{{- $root := index . 1 }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) }}
{{- end }}

{{/* Namespaces that get a Role with rbac.scope=namespace; the release namespace by default. */}}
{{- define "packtrain.roleNamespaces" -}}
{{- if .Values.operator.watchNamespaces }}
{{- toJson .Values.operator.watchNamespaces }}
{{- else }}
{{- toJson (list .Release.Namespace) }}
{{- end }}
{{- end }}
