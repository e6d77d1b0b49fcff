{{- define "gpu-agent.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpu-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gpu-agent.labels" -}}
{{ include "gpu-agent.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "gpu-agent.configMapName" -}}
{{- if .Values.config.name -}}
{{- .Values.config.name -}}
{{- else -}}
{{- printf "%s-config" (include "gpu-agent.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The container is privileged where a feature cannot work otherwise (see values.yaml). */}}
{{- define "gpu-agent.privileged" -}}
{{- if or (eq .Values.mig.access "manage") .Values.driver.root -}}true{{- end -}}
{{- end -}}

{{- define "gpu-agent.nvmlLib" -}}
{{- if .Values.driver.nvmlLib -}}
{{- .Values.driver.nvmlLib -}}
{{- else if .Values.driver.root -}}
{{- printf "/driver-root/%s" (.Values.driver.libPath | trimPrefix "/") -}}
{{- end -}}
{{- end -}}

{{/* The mps-host DaemonSet: its own name and selector, so that neither
DaemonSet's selector nor the metrics Service ever selects the other's pods. */}}
{{- define "gpu-agent.mpsName" -}}
{{- printf "%s-mps" (include "gpu-agent.fullname" . | trunc 59 | trimSuffix "-") -}}
{{- end -}}

{{- define "gpu-agent.mpsSelectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-mps
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gpu-agent.mpsLabels" -}}
{{ include "gpu-agent.mpsSelectorLabels" . }}
app.kubernetes.io/component: mps-host
app.kubernetes.io/part-of: {{ .Chart.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The ComputeDomain controller's Deployment, service account and Lease. */}}
{{- define "gpu-agent.controllerName" -}}
{{- printf "%s-controller" (include "gpu-agent.fullname" . | trunc 52 | trimSuffix "-") -}}
{{- end -}}

{{- define "gpu-agent.controllerSelectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-controller
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gpu-agent.controllerLabels" -}}
{{ include "gpu-agent.controllerSelectorLabels" . }}
app.kubernetes.io/component: controller
app.kubernetes.io/part-of: {{ .Chart.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The agent serves DRA with dra.enabled, and for compute domains, whose node side is its DRA driver
compute-domain.nvidia.com: computeDomains.enabled alone turns the whole feature on. */}}
{{- define "gpu-agent.dra" -}}
{{- if or .Values.dra.enabled .Values.computeDomains.enabled -}}true{{- end -}}
{{- end -}}
